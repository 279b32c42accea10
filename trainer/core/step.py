"""The adapter's single entry point: rollouts' calls → weighted samples of optimizer steps.

    dedup (per attempt) → merge (per rollout) → advantages (per group) → loss weights (per step)

`build_step` makes one optimizer step of a batch of rollouts; `build_steps` cuts a batch into
several steps without splitting a rollout, with the advantages computed once over the whole batch
(so a group cut across steps keeps its baseline) and the loss weights per step. The live trainer
and the replay tool both call these; each stage is also public for inspection and tests.
Advantages are only meaningful when each group's rollouts are all in the batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import msgspec

from trainer.core.advantages import group_advantages, group_baselines
from trainer.core.batching import plan_steps
from trainer.core.calls import RolloutCalls
from trainer.core.config import AdapterConfig
from trainer.core.dedup import dedup_calls
from trainer.core.merge import Sample, merge_calls
from trainer.core.weights import loss_weights


class MergedRollout(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout after dedup and merge: its reward (filled if configured) and its samples."""

    rollout_id: str
    group_id: str | None
    reward: float
    samples: list[Sample]
    calls: int
    calls_deduped: int
    calls_too_long: int
    calls_context: int = 0
    failure: str | None = None

    @property
    def tokens(self) -> int:
        """All tokens of its samples (the forward-pass cost)."""
        return sum(len(s.tokens) for s in self.samples)


class StepFigures(msgspec.Struct, frozen=True, kw_only=True):
    """The figures of a set of rollouts turned into samples: one step's (`StepStats`), a replay's
    (`services.tools.report.ReplaySummary`). Declared once, so both speak of the same things.

    Rollouts without a group id are their own group and counted as `ungrouped`.
    `rollouts_dropped_no_reward` counts batch-level drops (a step's: on the first step only).
    """

    rollouts: int
    rollouts_dropped_no_reward: int
    rollouts_without_samples: int
    ungrouped_rollouts: int
    groups: int
    calls: int
    calls_deduped: int
    calls_too_long: int
    samples: int
    merge_ratio: float
    samples_per_rollout_mean: float
    samples_per_rollout_max: int
    single_sample_rollouts: int
    tokens: int
    response_tokens: int
    reward_mean: float
    min_weights_version: int | None
    max_weights_version: int | None
    calls_context: int = 0
    """`ok` calls the run does not train (other agents or models): context, never samples."""
    rollouts_failed_scored: int = 0
    """Rollouts the policy made fail, kept in their group with `failed_reward`."""
    rollouts_failed_dropped: int = 0
    groups_skipped: int = 0
    rollouts_in_skipped_groups: int = 0


class StepStats(StepFigures, frozen=True, kw_only=True):
    """Figures of one step, for logs and for comparing schemes on replay.

    `group_baselines` is each declared group's mean reward at the configured level (over rollouts,
    or over samples).
    """

    group_baselines: dict[str, float]


class StepBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One optimizer step: samples with `advantage` and `token_weight` set, and the step's figures."""

    samples: list[Sample]
    stats: StepStats


def _group_key(group_id: str | None, rollout_id: str) -> Hashable:
    return ("group", group_id) if group_id is not None else ("rollout", rollout_id)


def merge_rollout(rollout: RolloutCalls, config: AdapterConfig, reward: float) -> MergedRollout:
    """Dedup then merge one rollout's calls under `config` (its reward already decided)."""
    calls = dedup_calls(rollout.calls, rollout.context)
    merged = merge_calls(
        calls,
        rollout_id=rollout.rollout_id,
        group_id=rollout.group_id,
        mode=config.merge,
        max_length=config.max_length,
    )
    return MergedRollout(
        rollout_id=rollout.rollout_id,
        group_id=rollout.group_id,
        reward=reward,
        samples=merged.samples,
        calls=len(rollout.calls),
        calls_deduped=len(rollout.calls) - len(calls),
        calls_too_long=merged.calls_too_long,
        calls_context=len(rollout.context),
        failure=rollout.failure,
    )


def rollout_reward(rollout: RolloutCalls, config: AdapterConfig) -> float | None:
    """The reward a rollout trains with: its own, else the configured fill (None: it is dropped).

    A rollout the policy made fail (`failure` set) scores `failed_reward` whatever it reported.
    """
    if rollout.failure is not None:
        return config.failure_reward()
    return rollout.reward if rollout.reward is not None else config.fill_reward()


class Drops(msgspec.Struct, frozen=True, kw_only=True):
    """Rollouts of a batch left out before advantages, by why."""

    no_reward: int = 0
    failed: int = 0
    """Rollouts the policy made fail, dropped because `failed_reward = "drop"`."""
    groups_skipped: int = 0
    """Declared groups left with fewer than two rollouts: no baseline to compare against."""
    in_skipped_groups: int = 0

    @property
    def total(self) -> int:
        """Every rollout left out."""
        return self.no_reward + self.failed + self.in_skipped_groups


def merge_settings(config: AdapterConfig) -> Hashable:
    """What of `config` `merge_rollouts` reads: configs equal in it merge a batch into equal results.

    Schemes that differ only in advantages or loss normalization can then share one merge, most of
    a batch's cost (the replay's `--compare`).
    """
    return (config.merge, config.max_length, config.failure_reward(), config.fill_reward())


def merge_rollouts(rollouts: Sequence[RolloutCalls], config: AdapterConfig) -> tuple[list[MergedRollout], Drops]:
    """Every rollout deduplicated and merged; rollouts without a reward dropped or filled.

    A group declared with two rollouts or more (`group_size`) but left with fewer than two (the
    others failed on the infrastructure, or had no reward) is skipped: a lone rollout has no
    baseline. Returns the merged rollouts (input order) and what was dropped.
    """
    seen: set[str] = set()
    kept: list[tuple[RolloutCalls, float]] = []
    no_reward = failed = 0
    for rollout in rollouts:
        if rollout.rollout_id in seen:
            raise ValueError(f"rollout {rollout.rollout_id} appears twice in the batch; pass each rollout once")
        seen.add(rollout.rollout_id)
        reward = rollout_reward(rollout, config)
        if reward is None:
            if rollout.failure is not None:
                failed += 1
            else:
                no_reward += 1
            continue
        kept.append((rollout, reward))
    sizes = Counter(r.group_id for r, _ in kept if r.group_id is not None)
    declared = {r.group_id: r.group_size for r, _ in kept if r.group_size is not None}
    lone = {g for g, n in sizes.items() if n < 2 and (declared.get(g) or 0) >= 2}
    merged = [merge_rollout(r, config, reward) for r, reward in kept if r.group_id not in lone]
    drops = Drops(
        no_reward=no_reward, failed=failed, groups_skipped=len(lone), in_skipped_groups=len(kept) - len(merged)
    )
    return merged, drops


def rollout_advantages(
    merged: Sequence[MergedRollout], config: AdapterConfig
) -> tuple[list[list[float]], dict[str, float]]:
    """Each sample's advantage (`[rollout][sample]`) and each declared group's baseline.

    At the `rollout` level every rollout is one entry (rollouts without samples still count: their
    reward is a sample of the task's return); at the `sample` level every sample is one entry.
    """
    if config.advantage_level == "rollout":
        rewards = [m.reward for m in merged]
        keys = [_group_key(m.group_id, m.rollout_id) for m in merged]
    else:
        rewards = [m.reward for m in merged for _ in m.samples]
        keys = [_group_key(m.group_id, m.rollout_id) for m in merged for _ in m.samples]
    values = group_advantages(rewards, keys, estimator=config.estimator, scale_std=config.scale_std, eps=config.std_eps)
    if config.advantage_level == "rollout":
        advantages = [[a] * len(m.samples) for a, m in zip(values, merged, strict=True)]
    else:
        flat = iter(values)
        advantages = [[next(flat) for _ in m.samples] for m in merged]
    baselines = {
        key[1]: value
        for key, value in group_baselines(rewards, keys).items()
        if isinstance(key, tuple) and key[0] == "group"
    }
    return advantages, baselines


def _versions(samples: Sequence[Sample]) -> tuple[int | None, int | None]:
    lows = [s.min_weights_version for s in samples if s.min_weights_version is not None]
    highs = [s.max_weights_version for s in samples if s.max_weights_version is not None]
    return (min(lows) if lows else None, max(highs) if highs else None)


def _finish_step(
    merged: Sequence[MergedRollout],
    advantages: Sequence[Sequence[float]],
    baselines: dict[str, float],
    config: AdapterConfig,
    drops: Drops,
) -> StepBatch:
    raw = [s for m in merged for s in m.samples]
    weights = loss_weights(raw, config.norm)
    flat_adv = [a for per in advantages for a in per]
    samples = [
        msgspec.structs.replace(s, advantage=a, token_weight=w) for s, a, w in zip(raw, flat_adv, weights, strict=True)
    ]
    counts = [len(m.samples) for m in merged]
    merged_calls = sum(s.num_calls for s in samples)
    low, high = _versions(samples)
    groups = {m.group_id for m in merged if m.group_id is not None}
    stats = StepStats(
        rollouts=len(merged),
        rollouts_dropped_no_reward=drops.no_reward,
        rollouts_without_samples=sum(1 for c in counts if c == 0),
        ungrouped_rollouts=sum(1 for m in merged if m.group_id is None),
        groups=len(groups),
        calls=sum(m.calls for m in merged),
        calls_deduped=sum(m.calls_deduped for m in merged),
        calls_too_long=sum(m.calls_too_long for m in merged),
        samples=len(samples),
        merge_ratio=merged_calls / len(samples) if samples else 0.0,
        samples_per_rollout_mean=len(samples) / len(merged) if merged else 0.0,
        samples_per_rollout_max=max(counts, default=0),
        single_sample_rollouts=sum(1 for c in counts if c == 1),
        tokens=sum(len(s.tokens) for s in samples),
        response_tokens=sum(s.response_tokens for s in samples),
        reward_mean=sum(m.reward for m in merged) / len(merged) if merged else 0.0,
        group_baselines={g: baselines[g] for g in sorted(groups) if g in baselines},
        min_weights_version=low,
        max_weights_version=high,
        calls_context=sum(m.calls_context for m in merged),
        rollouts_failed_scored=sum(1 for m in merged if m.failure is not None),
        rollouts_failed_dropped=drops.failed,
        groups_skipped=drops.groups_skipped,
        rollouts_in_skipped_groups=drops.in_skipped_groups,
    )
    return StepBatch(samples=samples, stats=stats)


def build_steps(
    rollouts: Sequence[RolloutCalls],
    config: AdapterConfig,
    *,
    max_tokens: int | None = None,
    max_rollouts: int | None = None,
) -> list[StepBatch]:
    """A batch of rollouts as optimizer steps (at most `max_tokens` sample tokens / `max_rollouts` each).

    Advantages are computed over the whole batch, loss weights within each step; a rollout is
    never split (one larger than `max_tokens` makes a step alone). An empty batch gives one empty
    step, so the figures of a batch that was all dropped are still reported.
    """
    merged, drops = merge_rollouts(rollouts, config)
    advantages, baselines = rollout_advantages(merged, config)
    plan = plan_steps([m.tokens for m in merged], max_tokens=max_tokens, max_rollouts=max_rollouts) or [[]]
    steps = []
    for n, idx in enumerate(plan):
        part = [merged[i] for i in idx]
        steps.append(_finish_step(part, [advantages[i] for i in idx], baselines, config, drops if n == 0 else Drops()))
    return steps


def build_step(rollouts: Sequence[RolloutCalls], config: AdapterConfig) -> StepBatch:
    """One optimizer step from a batch of rollouts: dedup → merge → advantages → loss weights."""
    merged, drops = merge_rollouts(rollouts, config)
    advantages, baselines = rollout_advantages(merged, config)
    return _finish_step(merged, advantages, baselines, config, drops)
