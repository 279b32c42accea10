"""`rollwire replay`: a replay rebuilds exactly what the trainer's adapter builds, one group at a time."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from agentrun import agent_run
from replay_support import CliResult, publish

from schemas import (
    AttemptStarted,
    CustomEvent,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    RunStarted,
)
from schemas.runs import RunSpec
from services.common.eventstore import EventStore
from services.tools import replay, source
from services.tools.replay import ReplayReport, replay_run, split_units
from services.tools.schemes import parse_spec
from services.tools.source import Unit
from trainer.core import AdapterConfig, AdapterConfigError, StepBatch, build_step, collect_rollouts, drop_stale_calls

Rollwire = Callable[..., CliResult]

SCHEMES = ["merge=exact", "per-call+token-mean", "sample+rloo+std+seq-mean-token-mean", "rloo+rollout-mean"]


def _sample_key(s: Any) -> tuple[Any, ...]:
    return (s.rollout_id, s.group_id, s.index, s.response_tokens, s.advantage, s.token_weight)


def _assert_same(report_scheme: Any, step: StepBatch) -> None:
    """The replayed scheme equals the trainer's step: every sample, every figure, bit for bit."""
    built = [(*_sample_key(s), len(s.tokens) - s.response_tokens) for s in step.samples]
    replayed = [(*_sample_key(s), s.prompt_tokens) for s in report_scheme.samples]
    assert replayed == built
    stats = msgspec.structs.asdict(step.stats)
    summary = msgspec.structs.asdict(report_scheme.summary)
    for name, value in stats.items():
        if name == "group_baselines":
            assert {g.group_id: g.baseline for g in report_scheme.groups} == value
        else:
            assert summary[name] == value, name


async def _replay(nats_url: str, run_id: str, **kw: Any) -> ReplayReport:
    store = await EventStore.connect(nats_url)
    try:
        return await replay_run(store, run_id, **kw)
    finally:
        await store.close()


async def test_replay_equals_build_step_over_the_whole_run(store: EventStore, nats_url: str, run_id: str) -> None:
    events = agent_run(run_id, groups=6, per_group=4, seed=3)
    await store.append_many(events)
    # A tiny call budget makes the replay read the run in many small chunks of whole groups.
    report = await _replay(nats_url, run_id, compare_specs=SCHEMES, budget=7)
    collected = collect_rollouts(events)
    assert len(report.schemes) == len(SCHEMES)
    for scheme in report.schemes:
        _assert_same(scheme, build_step(collected.rollouts, scheme.config))
        assert scheme.summary.rollouts_skipped == {"not-succeeded": 1, "val-mode": 1}
    assert report.comparison is not None and report.comparison.reference == "merge=exact"


async def test_a_rollout_with_a_malformed_call_is_skipped_as_the_trainer_skips_it(
    store: EventStore, nats_url: str, run_id: str
) -> None:
    good = agent_run(run_id, groups=2, per_group=2, seed=7)
    bad = _scripted(run_id, "bad", "g0", 1.0, [3])
    bad[3] = msgspec.structs.replace(bad[3], prompt_ids=[])  # the engine returned no token ids
    await store.append_many(good + bad)
    report = await _replay(nats_url, run_id)
    (scheme,) = report.schemes
    assert scheme.summary.rollouts_skipped == {"malformed-call": 1, "not-succeeded": 1, "val-mode": 1}
    _assert_same(scheme, build_step(collect_rollouts(good).rollouts, scheme.config))


@pytest.mark.parametrize("in_metadata", [False, True], ids=["train_step-events", "creation-metadata"])
async def test_replay_of_a_trainer_step_equals_what_the_trainer_built(
    store: EventStore, nats_url: str, run_id: str, in_metadata: bool
) -> None:
    config = {"merge": "exact", "estimator": "rloo", "norm": "seq-mean-token-mean"}
    events: list[Event] = [RunStarted(run_id=run_id, spec=RunSpec(run_id=run_id))]
    events += agent_run(run_id, groups=6, per_group=3, steps=3, seed=5, step_in_metadata=in_metadata)
    await store.append_many(events)
    recorded = [(e.rollout_id, e.payload["step"]) for e in events if isinstance(e, CustomEvent)]
    declared = [(e.rollout_id, e.metadata["step"]) for e in events if isinstance(e, RolloutCreated) and e.metadata]
    steps = dict(declared if in_metadata else recorded)
    assert len(steps) == 6 * 3 + 1
    collected = collect_rollouts(events)
    for n in range(3):
        # What the trainer built live in step n: build_step over that step's rollouts, its recorded config.
        trained = [r for r in collected.rollouts if steps.get(r.rollout_id) == n]
        live = build_step(trained, AdapterConfig.from_mapping(config))
        report = await _replay(nats_url, run_id, step=n, options=config)
        (scheme,) = report.schemes
        assert scheme.config == AdapterConfig.from_mapping(config)
        _assert_same(scheme, live)
        assert scheme.summary.steps == [n]


async def test_replay_of_an_async_step_drops_the_stale_calls_the_trainer_dropped(
    store: EventStore, nats_url: str, run_id: str
) -> None:
    events = agent_run(run_id, groups=4, per_group=3, steps=1, seed=11)
    calls = 0
    for i, event in enumerate(events):  # calls alternate between weights v1 (stale at v3) and v3
        if isinstance(event, ModelRequestRecorded):
            events[i] = msgspec.structs.replace(event, weights_version=1 if calls % 2 else 3)
            calls += 1
        elif isinstance(event, CustomEvent) and event.name == "train_step":
            events[i] = msgspec.structs.replace(
                event, payload={**event.payload, "weights_version": 3, "max_staleness": 1}
            )
    await store.append_many(events)
    trained = collect_rollouts(events).rollouts
    kept, dropped = drop_stale_calls(trained, 3, 1)
    assert dropped > 0
    live = build_step(kept, AdapterConfig())
    (scheme,) = (await _replay(nats_url, run_id, step=0)).schemes
    _assert_same(scheme, live)
    assert scheme.summary.calls < build_step(trained, AdapterConfig()).stats.calls


async def test_without_step_each_step_is_weighted_on_its_own(store: EventStore, nats_url: str, run_id: str) -> None:
    events = agent_run(run_id, groups=4, per_group=3, steps=2, seed=9)
    await store.append_many(events)
    report = await _replay(nats_url, run_id)
    scheme = report.schemes[0]
    assert scheme.summary.steps == [0, 1]
    for n in (0, 1):  # rollout-mean: the rollouts with tokens of each step share its loss equally
        shares = [r.loss_weight for r in scheme.rollouts if r.step == n and r.response_tokens]
        assert sum(shares) == pytest.approx(1.0) and max(shares) == pytest.approx(min(shares))


# ---- the design's worked examples, through the CLI's JSON ---------------------------------------


def _scripted(run_id: str, rollout_id: str, group: str, reward: float, responses: list[int]) -> list[Event]:
    """A rollout whose calls never extend each other: one sample per call, of the given response lengths."""
    calls = [
        ModelRequestRecorded(
            run_id=run_id, rollout_id=rollout_id, attempt_id="a1", call_id=f"{rollout_id}-{i}",
            prompt_ids=[900 + i, 1, 2], response_ids=[5] * n, logprobs=[-0.1] * n,
        )
        for i, n in enumerate(responses)
    ]  # fmt: skip
    return [
        RolloutCreated(run_id=run_id, rollout_id=rollout_id, group_id=group),
        AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", sequence=1),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", status="running"),
        *calls,
        RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", value=reward),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", status="succeeded"),
    ]


def test_design_example_rollout_baseline_one_half_sample_baseline_three_quarters(
    rollwire: Rollwire, nats_url: str, run_id: str
) -> None:
    publish(nats_url, _scripted(run_id, "r1", "g", 1.0, [3, 3, 3]) + _scripted(run_id, "r2", "g", 0.0, [3]))
    result = rollwire("replay", run_id, "--format", "json")
    assert result.exit_code == 0, result.stderr
    (scheme,) = json.loads(result.stdout)["schemes"]
    assert scheme["groups"] == [{"group_id": "g", "step": None, "rollouts": 2, "samples": 4, "baseline": 0.5}]
    assert [s["advantage"] for s in scheme["samples"]] == [0.5, 0.5, 0.5, -0.5]
    assert scheme["summary"]["samples_per_rollout"] == {"1": 1, "3": 1}

    result = rollwire("replay", run_id, "--advantage", "sample", "--format", "json")
    (scheme,) = json.loads(result.stdout)["schemes"]
    assert scheme["groups"][0]["baseline"] == 0.75
    assert [s["advantage"] for s in scheme["samples"]] == [0.25, 0.25, 0.25, -0.75]


def test_design_example_loss_normalizations_side_by_side(rollwire: Rollwire, nats_url: str, run_id: str) -> None:
    publish(
        nats_url,
        _scripted(run_id, "A", "g", 1.0, [50, 100]) + _scripted(run_id, "B", "g", 0.0, [30, 30, 30])
        + _scripted(run_id, "C", "g", 1.0, [40]),
    )  # fmt: skip
    result = rollwire(
        "replay", run_id, "--compare", "rollout-mean", "seq-mean-token-mean", "token-mean", "--format", "json"
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    by_name = {s["name"]: s for s in report["schemes"]}
    assert list(by_name) == ["rollout-mean", "seq-mean-token-mean", "token-mean"]

    def weights(name: str) -> list[float]:
        return [s["token_weight"] for s in by_name[name]["samples"]]

    # token-mean divides all six sums by 280; seq-mean averages six per-sample means;
    # rollout-mean averages (A1+A2)/150, (B1+B2+B3)/90 and C1/40.
    assert weights("token-mean") == pytest.approx([1 / 280] * 6)
    assert weights("seq-mean-token-mean") == pytest.approx([1 / 300, 1 / 600, 1 / 180, 1 / 180, 1 / 180, 1 / 240])
    assert weights("rollout-mean") == pytest.approx([1 / 450, 1 / 450, 1 / 270, 1 / 270, 1 / 270, 1 / 120])
    per_rollout = {r["rollout_id"]: r["loss_weight"] for r in report["comparison"]["rollouts"]}
    assert per_rollout == {"A": pytest.approx({"rollout-mean": 1 / 3, "seq-mean-token-mean": 2 / 6,
                                               "token-mean": 150 / 280}),
                           "B": pytest.approx({"rollout-mean": 1 / 3, "seq-mean-token-mean": 3 / 6,
                                               "token-mean": 90 / 280}),
                           "C": pytest.approx({"rollout-mean": 1 / 3, "seq-mean-token-mean": 1 / 6,
                                               "token-mean": 40 / 280})}  # fmt: skip
    shifts = {s["scheme"]: s for s in report["comparison"]["shifts"]}
    assert shifts["seq-mean-token-mean"]["gained"] == 1 and shifts["seq-mean-token-mean"]["lost"] == 1
    assert shifts["seq-mean-token-mean"]["largest_gain"]["rollout_id"] == "B"
    assert shifts["token-mean"]["largest_loss"]["rollout_id"] == "C"

    table = rollwire("replay", run_id, "--compare", "rollout-mean", "token-mean")
    assert "token-mean: 1 rollouts gain, 2 lose" in table.stdout


def test_csv_and_plot(rollwire: Rollwire, nats_url: str, run_id: str, tmp_path: Path) -> None:
    publish(nats_url, agent_run(run_id, groups=3, per_group=3, seed=2))
    out, png = tmp_path / "samples.csv", tmp_path / "weights.png"
    result = rollwire("replay", run_id, "--format", "csv", "--out", str(out), "--compare", "token-mean",
                      "--plot", str(png))  # fmt: skip
    assert result.exit_code == 0, result.stderr
    header, *rows = out.read_text().splitlines()
    assert header.split(",") == [
        "scheme", "step", "rollout_id", "group_id", "index", "prompt_tokens", "response_tokens", "calls",
        "reward", "advantage", "token_weight",
    ]  # fmt: skip
    report = json.loads(rollwire("replay", run_id, "--format", "json", "--compare", "token-mean").stdout)
    assert len(rows) == sum(len(s["samples"]) for s in report["schemes"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_scheme_specs_use_the_adapters_values_and_errors() -> None:
    base = AdapterConfig()
    assert parse_spec("per-call+token-mean", base) == AdapterConfig(merge="per-call", norm="token-mean")
    assert parse_spec("advantage=sample+std=true", base) == AdapterConfig(advantage_level="sample", scale_std=True)
    assert parse_spec("estimator=rloo", base).estimator == "rloo"
    with pytest.raises(AdapterConfigError, match="sets scale_std twice"):
        parse_spec("no-std+std", base)
    with pytest.raises(AdapterConfigError, match="unknown scheme key 'normalize'"):
        parse_spec("normalize=token-mean", base)


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["--merge", "zip"], "merge = 'zip' is not allowed; choose one of: exact, per-call", 2),
        (["--norm", "mean"], "norm = 'mean' is not allowed; choose one of: token-mean", 2),
        (["--compare", "tokenmean"], "unknown scheme 'tokenmean'", 2),
        (["--compare", "estimator=ppo"], "estimator = 'ppo' is not allowed; choose one of: grpo, rloo", 2),
        (["--format", "xml"], "--format 'xml' is not allowed; choose one of: table, json, csv", 2),
        (["--step", "3"], "has no trainer step records", 1),
    ],
)
def test_wrong_options_give_one_line_and_a_non_zero_exit(
    rollwire: Rollwire, nats_url: str, run_id: str, args: list[str], message: str, code: int
) -> None:
    publish(nats_url, _scripted(run_id, "r1", "g", 1.0, [3]))
    result = rollwire("replay", run_id, *args)
    assert result.exit_code == code
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ") and message in result.stderr


def test_a_missing_run_and_an_unreachable_stream_give_one_line(rollwire: Rollwire, nats_url: str) -> None:
    result = rollwire("replay", "no-such-run")
    assert result.exit_code == 1
    assert result.stderr == f"error: run 'no-such-run' has no events on the stream at {nats_url}; " \
        "`rollwire runs` lists the runs\n"  # fmt: skip
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = rollwire("replay", "r", "--nats-url", f"nats://127.0.0.1:{port}")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: no NATS server answers at nats://127.0.0.1:{port}")
    assert len(result.stderr.splitlines()) == 1


def test_worker_processes_and_chunk_sizes_change_nothing(nats_url: str, run_id: str) -> None:
    """In this process or in workers, in one read or one group per read: the same report, byte for byte."""
    publish(nats_url, agent_run(run_id, groups=5, per_group=3, seed=4))
    specs = ["token-mean", "per-call+sample"]
    here = asyncio.run(_replay(nats_url, run_id, compare_specs=specs, workers=0))
    workers = asyncio.run(_replay(nats_url, run_id, compare_specs=specs, workers=2, budget=5))
    tiny = asyncio.run(_replay(nats_url, run_id, compare_specs=specs, workers=0, budget=1))
    assert msgspec.json.encode(here) == msgspec.json.encode(workers) == msgspec.json.encode(tiny)


async def test_the_index_reads_the_final_attempts_reward_under_a_late_reward_of_another_attempt(
    store: EventStore, nats_url: str, run_id: str
) -> None:
    """The index reads each rollout's newest small events only; a late reward of an earlier attempt
    sends it back for all the rollout's rewards."""

    def retried(rollout_id: str, late: str | None) -> list[Event]:
        call = ModelRequestRecorded(
            run_id=run_id, rollout_id=rollout_id, attempt_id="a2", call_id=f"{rollout_id}-c",
            prompt_ids=[7, 1, 2], response_ids=[5, 5], logprobs=[-0.1, -0.2],
        )  # fmt: skip
        return [
            RolloutCreated(run_id=run_id, rollout_id=rollout_id, group_id="g"),
            AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", sequence=1),
            RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", value=1.0),
            RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", status="requeuing"),
            AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id="a2", sequence=2),
            call,
            RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id="a2", value=0.25),
            RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id="a2", status="succeeded"),
            *([RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id=late, value=0.9)] if late else []),
        ]

    events = retried("late-a1", "a1") + retried("on-time", None) + _scripted(run_id, "other", "g", 0.0, [2])
    await store.append_many(events)
    report = await _replay(nats_url, run_id)
    (scheme,) = report.schemes
    rewards = {r.rollout_id: r.reward for r in scheme.rollouts}
    assert rewards == {"late-a1": 0.25, "on-time": 0.25, "other": 0.0}
    _assert_same(scheme, build_step(collect_rollouts(events).rollouts, scheme.config))


@pytest.mark.parametrize("one_by_one", [64, 0])
async def test_statuses_without_an_attempt_take_the_newest_attempt_as_the_trainer_does(
    store: EventStore, nats_url: str, run_id: str, one_by_one: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index reads attempts only for rollouts whose final status names none (one by one, or all at
    once when many do); their calls and rewards are then the newest attempt's, as `build_step` takes them."""
    monkeypatch.setattr(source, "ATTEMPTS_ONE_BY_ONE", one_by_one)

    def anonymous(rollout_id: str) -> list[Event]:
        def call(attempt: str, ids: list[int]) -> ModelRequestRecorded:
            return ModelRequestRecorded(
                run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, call_id=f"{rollout_id}-{attempt}",
                prompt_ids=ids, response_ids=[5, 5], logprobs=[-0.1, -0.2],
            )  # fmt: skip

        return [
            RolloutCreated(run_id=run_id, rollout_id=rollout_id, group_id="g"),
            AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", sequence=1),
            call("a1", [7, 1]),
            RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", value=1.0),
            AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id="a2", sequence=2),
            call("a2", [7, 1, 2, 3]),
            RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id="a2", value=0.25),
            RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, status="succeeded"),
        ]

    events = anonymous("x") + anonymous("y") + _scripted(run_id, "named", "g", 0.0, [2])
    await store.append_many(events)
    report = await _replay(nats_url, run_id)
    (scheme,) = report.schemes
    assert {r.rollout_id: r.reward for r in scheme.rollouts} == {"x": 0.25, "y": 0.25, "named": 0.0}
    assert {s.rollout_id: s.prompt_tokens for s in scheme.samples if s.rollout_id != "named"} == {"x": 4, "y": 4}
    _assert_same(scheme, build_step(collect_rollouts(events).rollouts, scheme.config))


def test_the_forkserver_preloads_what_the_main_script_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker re-runs the main script; the modules it took names from are imported once, before."""
    main = types.ModuleType("__main__")
    names = {"json": json, "Path": Path, "Local": type("Local", (), {"__module__": "__main__"})}
    vars(main).update(names, Gone=type("Gone", (), {"__module__": "not_imported_anywhere"}))
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert replay._main_imports() == ["json", "pathlib"]


def test_workers_shares_are_runs_of_consecutive_groups_of_about_equal_calls() -> None:
    units = [
        Unit(step=None, group_id=f"g{i}", rollout_ids=[f"r{i}"], calls=c) for i, c in enumerate([5, 1, 4, 4, 2, 4])
    ]
    shares = split_units(units, 2)
    assert [u for share in shares for u in share] == units  # every group once, in run order
    assert [sum(u.calls for u in share) for share in shares] == [10, 10]
    assert len(split_units(units, 4)) == 4 and split_units(units[:1], 3) == [units[:1]] and split_units([], 2) == []


def _multi_agent(run_id: str, rollout_id: str, reward: float) -> list[Event]:
    """A writer on two replicas of `policy` (2 and 3 response tokens), a checker on `judge` (1 token)."""
    calls = [
        ModelRequestRecorded(
            run_id=run_id, rollout_id=rollout_id, attempt_id="a1", call_id=f"{rollout_id}-{i}", agent=agent,
            endpoint=endpoint, prompt_ids=[900 + i, 1, 2], response_ids=[5] * n, logprobs=[-0.1] * n,
        )
        for i, (agent, endpoint, n) in enumerate([("writer", "policy-r0", 2), ("checker", "judge", 1),
                                                  ("writer", "policy-r12", 3), ("checker", "policy-r1", 4)])
    ]  # fmt: skip
    return [
        RolloutCreated(run_id=run_id, rollout_id=rollout_id, group_id="g"),
        AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", sequence=1),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", status="running"),
        *calls,
        RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", value=reward),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id="a1", status="succeeded"),
    ]


@pytest.mark.parametrize(
    ("args", "trained"),
    [
        ((), [1, 2, 3, 4]),
        (("--agents", "writer"), [2, 3]),
        (("--agents", "checker"), [1, 4]),
        (("--models", "policy"), [2, 3, 4]),  # replicas `policy-r0`, `policy-r1`, `policy-r12` are `policy`
        (("--models", "judge"), [1]),
        (("--agents", "writer,checker", "--models", "policy"), [2, 3, 4]),
        (("--agents", "checker", "--models", "policy"), [4]),
        (("--agents", "all", "--models", "policy-r1"), [4]),  # one replica by its own name
    ],
)
def test_agents_and_models_select_the_trained_calls_through_the_cli(
    rollwire: Rollwire, nats_url: str, run_id: str, args: tuple[str, ...], trained: list[int]
) -> None:
    publish(nats_url, _multi_agent(run_id, "ra", 1.0) + _multi_agent(run_id, "rb", 0.0))
    result = rollwire("replay", run_id, *args, "--format", "json")
    assert result.exit_code == 0, result.stderr
    (scheme,) = json.loads(result.stdout)["schemes"]
    by_rollout = {
        r: sorted(s["response_tokens"] for s in scheme["samples"] if s["rollout_id"] == r) for r in "ra rb".split()
    }
    assert by_rollout == {"ra": trained, "rb": trained}
