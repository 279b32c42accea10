"""Advantages, loss weights, steps and micro-batches: the design's worked examples, exactly."""

from __future__ import annotations

import itertools
import math
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.core import (
    AdapterConfig,
    AdapterConfigError,
    CallTokens,
    RolloutCalls,
    build_step,
    build_steps,
    group_advantages,
    merge_rollouts,
    merge_settings,
    pack_bins,
    partition_balanced,
    plain,
    plan_micro_batches,
    plan_steps,
)

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None)


def rollout(
    rollout_id: str, response_lengths: list[int], reward: float | None, group: str | None = "g"
) -> RolloutCalls:
    """A rollout whose calls never chain (each prompt starts with its own token): one sample per call."""
    calls = [
        CallTokens(
            call_id=f"{rollout_id}-{i}",
            prompt_ids=[1000 + i, 7],
            response_ids=[5] * n,
            logprobs=[-0.1] * n,
            weights_version=i,
        )
        for i, n in enumerate(response_lengths)
    ]
    return RolloutCalls(run_id="r", rollout_id=rollout_id, group_id=group, attempt_id="a", reward=reward, calls=calls)


def test_design_example_rollout_level_baseline_is_one_half() -> None:
    step = build_step([rollout("r1", [3, 3, 3], 1.0), rollout("r2", [3], 0.0)], AdapterConfig())
    assert step.stats.group_baselines == {"g": 0.5}
    assert [(s.rollout_id, s.advantage) for s in step.samples] == [("r1", 0.5)] * 3 + [("r2", -0.5)]
    assert step.stats.samples_per_rollout_max == 3 and step.stats.single_sample_rollouts == 1


def test_design_example_sample_level_baseline_is_three_quarters() -> None:
    config = AdapterConfig(advantage_level="sample")
    step = build_step([rollout("r1", [3, 3, 3], 1.0), rollout("r2", [3], 0.0)], config)
    assert step.stats.group_baselines == {"g": 0.75}
    assert [s.advantage for s in step.samples] == [0.25, 0.25, 0.25, -0.75]


def test_grpo_rloo_and_std_scaling() -> None:
    rewards, groups = [1.0, 0.0, 0.0, 5.0, 3.0, 9.0], ["a", "a", "a", "b", "c", "c"]
    assert group_advantages(rewards, groups) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, -3.0, 3.0])
    assert group_advantages(rewards, groups, estimator="rloo") == pytest.approx([1.0, -0.5, -0.5, 0.0, -6.0, 6.0])
    std_a, std_c = math.sqrt(1 / 3), math.sqrt(18)  # sample std (n - 1)
    scaled = group_advantages(rewards, groups, scale_std=True, eps=0.0)
    assert scaled == pytest.approx([2 / 3 / std_a, -1 / 3 / std_a, -1 / 3 / std_a, 0.0, -3 / std_c, 3 / std_c])
    assert group_advantages([2.0, 2.0], ["x", "x"], scale_std=True) == [0.0, 0.0]


def test_rollouts_without_group_are_their_own_group() -> None:
    step = build_step([rollout("r1", [2], 1.0, group=None), rollout("r2", [2], 0.0, group=None)], AdapterConfig())
    assert [s.advantage for s in step.samples] == [0.0, 0.0]
    assert step.stats.ungrouped_rollouts == 2 and step.stats.group_baselines == {}


ABC = [rollout("A", [50, 100], 1.0), rollout("B", [30, 30, 30], 0.0), rollout("C", [40], 1.0)]


@pytest.mark.parametrize(
    ("norm", "expected"),
    [
        ("token-mean", [1 / 280] * 6),
        ("seq-mean-token-mean", [1 / 300, 1 / 600, 1 / 180, 1 / 180, 1 / 180, 1 / 240]),
        ("rollout-mean", [1 / 450, 1 / 450, 1 / 270, 1 / 270, 1 / 270, 1 / 120]),
    ],
)
def test_design_example_loss_weights(norm: str, expected: list[float]) -> None:
    step = build_step(ABC, AdapterConfig(norm=norm))  # type: ignore[arg-type]
    assert [s.token_weight for s in step.samples] == pytest.approx(expected, rel=1e-12)
    # Σ_samples w · Σ_tokens ℓ is the average the design states, for any token losses.
    rng = random.Random(0)
    sums = [sum(rng.random() for _ in range(s.response_tokens)) for s in step.samples]
    a1, a2, b1, b2, b3, c1 = sums
    loss = sum(s.token_weight * x for s, x in zip(step.samples, sums, strict=True))
    stated = {
        "token-mean": sum(sums) / 280,
        "seq-mean-token-mean": (a1 / 50 + a2 / 100 + b1 / 30 + b2 / 30 + b3 / 30 + c1 / 40) / 6,
        "rollout-mean": ((a1 + a2) / 150 + (b1 + b2 + b3) / 90 + c1 / 40) / 3,
    }[norm]
    assert loss == pytest.approx(stated, rel=1e-12)


@PROPERTY
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=5), min_size=1, max_size=6))
def test_rollout_mean_weight_of_a_rollout_does_not_depend_on_its_split(splits: list[list[int]]) -> None:
    rollouts = [rollout(f"r{i}", lengths, float(i % 2)) for i, lengths in enumerate(splits)]
    counted = sum(1 for lengths in splits if sum(lengths))
    for norm in ("token-mean", "seq-mean-token-mean", "rollout-mean"):
        step = build_step(rollouts, AdapterConfig(norm=norm))  # type: ignore[arg-type]
        total = sum(s.token_weight * s.response_tokens for s in step.samples)
        assert total == pytest.approx(1.0 if counted else 0.0)
    step = build_step(rollouts, AdapterConfig())
    for i, lengths in enumerate(splits):
        mass = sum(s.token_weight * s.response_tokens for s in step.samples if s.rollout_id == f"r{i}")
        assert mass == pytest.approx(1 / counted if sum(lengths) else 0.0)
    # The same rollouts with their tokens in one sample each get the same total weight.
    pooled = build_step([rollout(f"r{i}", [sum(ls)], float(i % 2)) for i, ls in enumerate(splits)], AdapterConfig())
    for s in pooled.samples:
        assert s.token_weight * s.response_tokens == pytest.approx(1 / counted if s.response_tokens else 0.0)


def test_missing_reward_drop_or_fill() -> None:
    rollouts = [rollout("r1", [4], 1.0), rollout("r2", [4], None)]
    dropped = build_step(rollouts, AdapterConfig())
    assert dropped.stats.rollouts == 1 and dropped.stats.rollouts_dropped_no_reward == 1
    filled = build_step(rollouts, AdapterConfig(missing_reward=-1))
    assert [s.advantage for s in filled.samples] == [1.0, -1.0] and filled.stats.reward_mean == 0.0


def test_stats() -> None:
    r3 = rollout("r3", [5, 6], 0.0)  # its second call is too long for max_length=7
    retry = CallTokens(call_id="r3-retry", prompt_ids=[1000, 7], response_ids=[9], logprobs=[-1.0])  # retries r3-0
    r3 = msgspec.structs.replace(r3, calls=[*r3.calls, retry])
    step = build_step([rollout("r1", [3, 3, 3], 1.0), rollout("r2", [], 0.0), r3], AdapterConfig(max_length=7))
    st_ = step.stats
    assert (st_.rollouts, st_.calls, st_.calls_deduped, st_.calls_too_long) == (3, 6, 1, 1)
    assert (st_.samples, st_.rollouts_without_samples, st_.single_sample_rollouts) == (4, 1, 1)
    assert st_.merge_ratio == 1.0 and st_.samples_per_rollout_mean == pytest.approx(4 / 3)
    assert (st_.response_tokens, st_.tokens) == (9 + 1, 3 * 5 + 3)
    assert (st_.min_weights_version, st_.max_weights_version) == (0, 2)
    assert st_.group_baselines == {"g": pytest.approx(1 / 3)}
    assert [s.call_ids for s in step.samples if s.rollout_id == "r3"] == [["r3-retry"]]


def test_build_steps_keeps_rollouts_whole_and_advantages_batch_wide() -> None:
    rollouts = [rollout(f"r{i}", [10] * (1 + i % 3), float(i % 2), group=f"g{i // 2}") for i in range(8)]
    config = AdapterConfig()
    whole = build_step(rollouts, config)
    steps = build_steps(rollouts, config, max_tokens=70)
    assert len(steps) > 1
    seen: list[str] = []
    for step in steps:
        ids = list(dict.fromkeys(s.rollout_id for s in step.samples))
        assert not set(ids) & set(seen), "a rollout was split across steps"
        seen += ids
        assert sum(s.token_weight * s.response_tokens for s in step.samples) == pytest.approx(1.0)
    adv = {(s.rollout_id, s.index): s.advantage for s in whole.samples}
    assert {(s.rollout_id, s.index): s.advantage for st_ in steps for s in st_.samples} == adv
    assert sum(st_.stats.rollouts for st_ in steps) == 8
    assert [len(p) for p in plan_steps([5, 5, 5], max_rollouts=2)] == [2, 1]
    assert plan_steps([50, 10], max_tokens=20) == [[0], [1]]
    assert build_steps([], config)[0].stats.rollouts == 0


def test_duplicate_rollouts_are_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        build_step([rollout("r1", [1], 1.0), rollout("r1", [1], 1.0)], AdapterConfig())


def test_config_errors_name_the_key_and_the_allowed_values() -> None:
    with pytest.raises(AdapterConfigError, match=r"norm = 'mean' is not allowed; choose one of: token-mean"):
        AdapterConfig.from_mapping({"norm": "mean"})
    with pytest.raises(AdapterConfigError, match=r"merge = 'fuzzy'.*exact, per-call"):
        AdapterConfig(merge="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(AdapterConfigError, match=r"unknown adapter setting.*nrom.*the settings are"):
        AdapterConfig.from_mapping({"nrom": "token-mean"})
    with pytest.raises(AdapterConfigError, match=r"missing_reward.*'drop' or a number"):
        AdapterConfig.from_mapping({"missing_reward": "zero"})
    with pytest.raises(AdapterConfigError, match="max_length"):
        AdapterConfig.from_mapping({"max_length": 0})
    assert AdapterConfig.from_mapping({"estimator": "rloo", "missing_reward": 0}).fill_reward() == 0.0


def _best_max_load(sizes: list[int], parts: int) -> int:
    return min(
        max(sum(s for s, p in zip(sizes, assign, strict=True) if p == q) for q in range(parts))
        for assign in itertools.product(range(parts), repeat=len(sizes))
    )


@PROPERTY
@given(st.lists(st.integers(1, 100), max_size=8), st.integers(1, 3))
def test_partition_balance_bounds(sizes: list[int], parts: int) -> None:
    bins = partition_balanced(sizes, parts)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in b) for b in bins]
    if sizes:
        assert max(loads) - min(loads) <= max(sizes)
        assert max(loads) <= (4 / 3 - 1 / (3 * parts)) * _best_max_load(sizes, parts) + 1e-9


@PROPERTY
@given(st.lists(st.integers(1, 100), max_size=30), st.integers(1, 4), st.integers(50, 200))
def test_micro_batches_cover_every_sample_once_within_budget(sizes: list[int], workers: int, budget: int) -> None:
    plan = plan_micro_batches(sizes, workers=workers, max_tokens=budget)
    assert len(plan) == workers and len({len(w) for w in plan}) <= 1
    assert sorted(i for w in plan for mb in w for i in mb) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in mb) <= budget or len(mb) == 1 for w in plan for mb in w)
    assert pack_bins([300, 10], 100) == [[0], [1]]


def test_configs_equal_in_merge_settings_merge_alike_and_the_settings_name_every_merge_input() -> None:
    """`merge_settings` is what lets compared schemes share one merge: every config change that changes
    `merge_rollouts`' result changes it, and the advantage and loss settings leave it as it is."""
    first = CallTokens(call_id="c1", prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.1, -0.2])
    second = CallTokens(call_id="c2", prompt_ids=[1, 2, 3, 4, 9], response_ids=[5] * 6, logprobs=[-0.3] * 6)
    batch = [
        RolloutCalls(run_id="r", rollout_id="chained", group_id="g", attempt_id="a", reward=1.0, calls=[first, second]),
        rollout("no-reward", [2], None),
        msgspec.structs.replace(rollout("failed", [2], None), failure="timeout"),
        rollout("other", [3], 0.0),
    ]
    base = AdapterConfig()
    variants = {
        "merge": AdapterConfig(merge="per-call"),
        "max_length": AdapterConfig(max_length=8),
        "missing_reward": AdapterConfig(missing_reward=0.5),
        "failed_reward": AdapterConfig(failed_reward="drop"),
        "advantage_level": AdapterConfig(advantage_level="sample"),
        "estimator": AdapterConfig(estimator="rloo"),
        "scale_std": AdapterConfig(scale_std=True),
        "std_eps": AdapterConfig(std_eps=0.1),
        "norm": AdapterConfig(norm="token-mean"),
    }
    assert set(variants) | {"agents", "models"} == set(AdapterConfig.__struct_fields__)  # a new field is listed here
    merged = plain(merge_rollouts(batch, base))
    for name, config in variants.items():
        differs = plain(merge_rollouts(batch, config)) != merged
        assert differs == (merge_settings(config) != merge_settings(base)), name
        assert differs == (name in ("merge", "max_length", "missing_reward", "failed_reward")), name
