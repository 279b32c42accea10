"""The quickstart, shortened: the whole loop turns on the real stack and the weights change.

It also checks that `rollwire replay --step N` rebuilds exactly the samples the trainer trained on
in step N (their sizes, advantages and loss weights), from the run's events alone.

Two steps of the real quickstart: embedded stack (nats-server, Postgres, vLLM, gateway,
projector, controller), the real agent harness launched by the controller through the fork
server, replay, update, reload. The model is a short warm start (seconds, not minutes), so the
harness runs with its tool-use reward: rewards then differ within groups, which every parameter
needs to receive a gradient.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import msgspec
import pytest
from safetensors.torch import load_file

from schemas import ModelRequestRecorded, PhaseChanged, RewardReported
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.tools.replay import replay_run
from trainer.quickstart.run import QuickstartOptions, run_quickstart
from trainer.quickstart.warmstart import WarmStartConfig, ensure_warm_model

pytestmark = pytest.mark.slow

SMOKE_WARM_START = WarmStartConfig(
    skill_max_steps=1,
    steps=60,
    max_steps=60,
    lr=3e-3,
    warmup_steps=5,
    tool_rate=0.5,
    transcripts=256,
    skill_transcripts=256,
)


async def run_events_and_replays(nats_dir: Path, run_id: str, steps: int) -> tuple[list, list[list[dict]]]:
    """The run's events, and `rollwire replay --step N`'s samples of each step, from the stopped stack's stream."""
    server = NatsServer(nats_dir).start()
    try:
        store = await EventStore.connect(server.url)
        try:
            events = [stored.event async for stored in store.read_run(run_id)]
            replays = []
            for step in range(1, steps + 1):
                report = await replay_run(store, run_id, step=step)
                replays.append([msgspec.to_builtins(row) for row in report.schemes[0].samples])
            return events, replays
        finally:
            await store.close()
    finally:
        server.stop()


def comparable(row: dict) -> tuple:
    """Every field of a `SampleRow`, floats rounded (sums may run in another order)."""
    return tuple(sorted((k, round(v, 9) if isinstance(v, float) else v) for k, v in row.items()))


@pytest.mark.timeout(1500)  # the stack starts vLLM twice (the run, then its resume): minutes each on 2 loaded cores
def test_two_quickstart_steps_update_every_parameter_and_serve_the_new_version(
    tmp_path: Path, model_cache: Path
) -> None:
    model_dir = ensure_warm_model(model_cache, SMOKE_WARM_START)
    options = QuickstartOptions(
        heldout_tasks=0,  # no held-out pass: this is about the steps
        steps=2,
        data_dir=tmp_path / "stack",
        out=tmp_path / "runs",
        tasks_per_step=6,
        rollouts_per_task=4,
        model_dir=model_dir,
        run_name="smoke",
        extra={"agent": {"env": {"AGENT_SEED": "0", "QUICKSTART_REWARD": "tool"}}},
    )
    result = run_quickstart(options, say=lambda line: None)

    assert [row["step"] for row in result.rows] == [1, 2]
    for row in result.rows:
        assert row["rollouts"] == 24 and row["rollouts_failed"] == 0
        assert row["samples"] > 0 and row["response_tokens"] > 0
    assert result.rows[-1]["weights_version"] == 2
    assert result.curve.read_bytes()[:4] == b"\x89PNG"
    assert (result.run_dir / "metrics.csv").read_text().count("\n") == 3

    before = load_file(result.run_dir / "weights" / "v0" / "model.safetensors")
    after = load_file(result.run_dir / "weights" / "v1" / "model.safetensors")
    assert before.keys() == after.keys()
    unchanged = [name for name in before if before[name].equal(after[name])]
    assert not unchanged, f"parameters not updated by step 1: {unchanged}"

    events, replays = asyncio.run(run_events_and_replays(tmp_path / "stack" / "nats", "smoke", 2))
    for step, replayed in enumerate(replays, start=1):
        trained = [json.loads(line) for line in result.run_dir.joinpath("samples", f"step-{step}.jsonl").open()]
        assert trained, f"step {step} trained on no sample"
        assert sorted(map(comparable, replayed)) == sorted(map(comparable, trained)), f"replay of step {step} differs"

    calls = [e for e in events if isinstance(e, ModelRequestRecorded)]
    rewards = [e for e in events if isinstance(e, RewardReported)]
    assert len(rewards) == 48 and len(calls) >= 48
    versions: dict[int, set[int | None]] = {}
    for call in calls:
        task_number = int(str(call.rollout_id).split("-g")[1].split("-")[0])
        step = 1 if task_number < 6 else 2
        versions.setdefault(step, set()).add(call.weights_version)
    assert versions == {1: {0}, 2: {1}}  # step 2's calls ran on the weights step 1 produced
    phases = [(e.phase, e.weights_version) for e in events if isinstance(e, PhaseChanged)]
    assert phases[-4:] == [("update", 0), ("rollout", 1), ("update", 1), ("rollout", 2)]
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["run"]["steps"] == 2

    # Resumed with one more step: the trainer continues from its checkpoint, never redoes a step.
    resumed = run_quickstart(
        dataclasses.replace(options, steps=3, extra={**options.extra, "run": {"resume": True}}), say=lambda line: None
    )
    assert [row["step"] for row in resumed.rows] == [3]
    assert resumed.rows[0]["weights_version"] == 3 and resumed.rows[0]["rollouts_failed"] == 0
    assert [line.split(",")[0] for line in (result.run_dir / "metrics.csv").read_text().splitlines()[1:]] == [
        "1", "2", "3",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)  # builds the warm start when it runs alone
def test_quickstart_on_the_verl_backend_updates_every_parameter(tmp_path: Path, model_cache: Path) -> None:
    """`backend.kind = "verl"` on the embedded stack: two steps through verl's FSDP2 engine (CPU platform)."""
    pytest.importorskip("verl")
    model_dir = ensure_warm_model(model_cache, SMOKE_WARM_START)
    options = QuickstartOptions(
        heldout_tasks=0,  # no held-out pass: this is about the steps
        steps=2,
        data_dir=tmp_path / "stack",
        out=tmp_path / "runs",
        tasks_per_step=6,
        rollouts_per_task=4,
        model_dir=model_dir,
        run_name="verl",
        extra={"agent": {"env": {"AGENT_SEED": "0", "QUICKSTART_REWARD": "tool"}}, "backend": {"kind": "verl"}},
    )
    result = run_quickstart(options, say=lambda line: None)
    assert [row["step"] for row in result.rows] == [1, 2]
    assert all(row["rollouts_failed"] == 0 and row["loss"] is not None for row in result.rows)
    assert result.rows[-1]["weights_version"] == 2
    before = load_file(result.run_dir / "weights" / "v0" / "model.safetensors")
    after = load_file(result.run_dir / "weights" / "v1" / "model.safetensors")
    assert before.keys() == after.keys()
    unchanged = [name for name in before if before[name].equal(after[name])]
    assert not unchanged, f"parameters not updated by step 1: {unchanged}"
