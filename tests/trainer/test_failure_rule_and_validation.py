"""The failure rule and the validation pass against a real NATS (and, for validation, a real gateway).

A group with a timed-out rollout gets the configured reward in its baseline; an image-pull failure
is dropped; both show in the step's metrics row. Validation rollouts are declared in `val` mode,
their rewards become `val/reward`, and the adapter never trains on them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from served import Served
from test_rollouts import rollout_events

from schemas import AttemptStarted, Event, PhaseChanged, RolloutCreated, RolloutStatusChanged
from services.common.eventstore import EventStore
from services.common.gateway_api import GatewayClient
from services.gateway import GatewaySettings, create_app
from trainer.checkpoint import InFlightGroup
from trainer.core import AdapterConfig, NotTrainable, build_step, rollout_calls
from trainer.rollouts import StatusWatch, replay_group, update_spans
from trainer.run.sections import ValidationSection
from trainer.step_row import step_row
from trainer.validation import VAL_REWARD, ValidationPass, val_reward

ADMIN = "failure-rule-admin"


def _failed(run_id: str, rollout_id: str, reason: str) -> list[Event]:
    attempt = f"{rollout_id}-a1"
    return [
        RolloutCreated(run_id=run_id, rollout_id=rollout_id, group_id="g", metadata={"group_size": 4}),
        AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, sequence=1),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, status="failed", reason=reason),
    ]


async def test_a_timed_out_rollout_scores_in_its_group_and_an_image_pull_failure_is_dropped(
    store: EventStore, run_id: str
) -> None:
    events: list[Event] = [*rollout_events(run_id, "r0", "g", 1.0, "succeeded"),
                           *rollout_events(run_id, "r1", "g", 1.0, "succeeded")]  # fmt: skip
    events += _failed(run_id, "r2", "timed out after 5s (stopped by the controller) (gave up after 1 of 1 attempt(s))")
    events += _failed(run_id, "r3", 'ImagePullBackOff: Back-off pulling image "agent:missing"')
    await store.append_many(events)
    group = InFlightGroup(group_id="g", rollout_ids=["r0", "r1", "r2", "r3"], task_index=0, created_version=0)
    replayed = await replay_group(store, run_id, group)
    assert replayed.skipped == {"r3": "infrastructure"}
    adapter = AdapterConfig(failed_reward=-1.0)
    batch = build_step(replayed.rollouts, adapter)
    assert batch.stats.group_baselines == {"g": pytest.approx((1.0 + 1.0 - 1.0) / 3)}
    row = step_row(1, 1, [replayed], batch, 0, 0, None, {}, adapter)
    assert row["rollouts_failed_scored"] == 1 and row["rollouts_infra_dropped"] == 1
    assert row["reward_mean"] == pytest.approx(1 / 3) and row["groups_skipped"] == 0


def _timed_out(run_id: str, rollout_id: str, began: float, ended: float) -> list[Event]:
    """A rollout whose attempt the controller stopped at its time limit (cause `timeout`)."""
    attempt = f"{rollout_id}-a1"
    reason = "timed out after 60s; the agent's process group was killed (gave up after 1 of 1 attempt(s))"
    return [
        RolloutCreated(run_id=run_id, rollout_id=rollout_id, group_id="g", metadata={"group_size": 4}, time=began),
        AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, sequence=1, time=began),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, status="failed",
                             reason=reason, cause="timeout", time=ended),
    ]  # fmt: skip


async def test_an_async_timeout_that_spans_an_update_is_not_the_policys(store: EventStore, run_id: str) -> None:
    """The update gate held the attempt's calls for part of its time limit: dropped, not scored."""
    events: list[Event] = [*rollout_events(run_id, "r0", "g", 1.0, "succeeded"),
                           *rollout_events(run_id, "r1", "g", 1.0, "succeeded"),
                           PhaseChanged(run_id=run_id, phase="update", time=1000.0),
                           PhaseChanged(run_id=run_id, phase="rollout", weights_version=1, time=1030.0),
                           *_timed_out(run_id, "held", 990.0, 1050.0),
                           *_timed_out(run_id, "free", 1100.0, 1160.0)]  # fmt: skip
    await store.append_many(events)
    updates = await update_spans(store, run_id)
    assert updates == [(1000.0, 1030.0)]
    group = InFlightGroup(group_id="g", rollout_ids=["r0", "r1", "held", "free"], task_index=0, created_version=0)
    replayed = await replay_group(store, run_id, group, None, updates)
    assert replayed.skipped == {"held": "infrastructure"}
    assert [r.failure for r in replayed.rollouts if r.rollout_id == "free"] == ["timeout"]


def test_val_reward_of_a_rollout() -> None:
    events = rollout_events("r", "v0", "g", 0.5, "succeeded")
    assert val_reward(events, AdapterConfig()) == 0.5
    with pytest.raises(NotTrainable, match="val"):
        rollout_calls([RolloutCreated(run_id="r", rollout_id="v0", mode="val"), *events[1:]])
    timed_out = _failed("r", "v1", "timed out after 3s")
    assert val_reward(timed_out, AdapterConfig(failed_reward=-2.0)) == -2.0
    assert val_reward(_failed("r", "v2", "Evicted from n1: low memory"), AdapterConfig()) is None


async def test_the_validation_pass_declares_val_rollouts_and_reports_their_reward(
    store: EventStore, nats_url: str, run_id: str, tmp_path: Path
) -> None:
    tasks = tmp_path / "val.jsonl"
    tasks.write_text("".join(json.dumps({"q": i}) + "\n" for i in range(3)))
    section = ValidationSection(path=str(tasks), every=2, rollouts_per_task=2)
    validation = ValidationPass(section, run_id, AdapterConfig())
    assert not validation.due(1) and validation.due(2)
    settings = GatewaySettings(nats_url=nats_url, admin_token=ADMIN, secret="v" * 32, port=0)
    with Served(create_app(settings)) as server:
        gateway = GatewayClient(server.url, ADMIN)
        watch = StatusWatch(store, run_id)
        await watch.start(await store.last_sequence())

        async def play_the_agents() -> None:
            """What the controller and the agents would do: run each val rollout, report a reward."""
            admin = httpx.AsyncClient(base_url=server.url, headers={"authorization": f"Bearer {ADMIN}"})
            async with admin:
                while True:
                    listed = (await admin.get("/api/rollouts", params={"run_id": run_id, "status": "queuing"})).json()
                    if listed:
                        break
                    await asyncio.sleep(0.05)
                for i, rollout in enumerate(sorted(listed, key=lambda r: r["rollout_id"])):
                    rid = rollout["rollout_id"]
                    assert rollout["mode"] == "val"
                    attempt = (await admin.post(f"/api/rollouts/{rid}/attempts", json={})).json()
                    aid = attempt["attempt_id"]
                    await admin.patch(f"/api/rollouts/{rid}", json={"status": "running", "attempt_id": aid})
                    await admin.post(f"/api/rollouts/{rid}/attempt/{aid}/events", json={"type": "reward", "value": i})
                    await admin.patch(f"/api/rollouts/{rid}", json={"status": "succeeded", "attempt_id": aid})

        agents = asyncio.create_task(play_the_agents())
        try:
            row = await asyncio.wait_for(validation.run(2, gateway, watch, store), 60)
        finally:
            await agents
            await watch.stop()
            await gateway.close()
    assert row == {VAL_REWARD: pytest.approx(sum(range(6)) / 6), "val_rollouts": 6}
