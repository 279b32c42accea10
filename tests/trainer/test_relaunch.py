"""A full crash mid-step: the resumed trainer relaunches the step's rollouts the crash lost.

Real NATS and a real gateway; the controller and the agents are played through the gateway's
admin API, with the statuses the controller writes (a lost execution ends `failed` with the cause
`infrastructure`: `services/controller/backends/local.py`, "the execution's supervisor died").
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from served import Served

from services.common.eventstore import EventStore
from services.common.gateway_api import GatewayClient, NewRollout
from services.gateway import GatewaySettings, create_app
from trainer.checkpoint import InFlightGroup
from trainer.relaunch import wait_relaunching
from trainer.rollouts import StatusWatch, replay_group

ADMIN = "relaunch-admin"
LOST = "the execution's supervisor died without recording an exit status (killed by the OS or a person?)"


async def _run_attempt(admin: httpx.AsyncClient, rid: str, end: str, reward: float | None = None) -> None:
    """What the controller and the agent do: start an attempt, run it, report, end it."""
    aid = (await admin.post(f"/api/rollouts/{rid}/attempts", json={})).json()["attempt_id"]
    await admin.patch(f"/api/rollouts/{rid}", json={"status": "running", "attempt_id": aid})
    if reward is not None:
        await admin.post(f"/api/rollouts/{rid}/attempt/{aid}/events", json={"type": "reward", "value": reward})
    body: dict[str, Any] = {"status": end, "attempt_id": aid}
    if end == "failed":
        body |= {"reason": LOST, "cause": "infrastructure"}
    assert (await admin.patch(f"/api/rollouts/{rid}", json=body)).status_code == 200


async def _play_relaunched(admin: httpx.AsyncClient, run_id: str, count: int) -> list[dict[str, Any]]:
    """Run the relaunched rollouts to success (reward 0) once they are declared; returns them."""
    while True:
        queued = (await admin.get("/api/rollouts", params={"run_id": run_id, "status": "queuing"})).json()
        if len(queued) >= count:
            break
        await asyncio.sleep(0.05)
    for rollout in queued:
        await _run_attempt(admin, rollout["rollout_id"], "succeeded", 0.0)
    return list(queued)


async def test_a_resumed_step_relaunches_the_rollouts_a_crash_lost(
    store: EventStore, nats_url: str, run_id: str
) -> None:
    settings = GatewaySettings(nats_url=nats_url, admin_token=ADMIN, secret="r" * 32, port=0)
    group = InFlightGroup(group_id=f"{run_id}-g0", rollout_ids=[f"{run_id}-g0-r{j}" for j in range(3)],
                          task_index=0, created_version=0)  # fmt: skip
    with Served(create_app(settings)) as server:
        gateway = GatewayClient(server.url, ADMIN)
        admin = httpx.AsyncClient(base_url=server.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
        try:
            declared = [NewRollout(rollout_id=r, group_id=group.group_id, input={"q": 0}) for r in group.rollout_ids]
            await gateway.create_rollouts(run_id, declared, key=f"{run_id}-declare")
            # Before the crash one rollout finished; after it, the controller ends the other two as lost.
            await _run_attempt(admin, group.rollout_ids[0], "succeeded", 1.0)
            for rid in group.rollout_ids[1:]:
                await _run_attempt(admin, rid, "failed")
            before = await replay_group(store, run_id, group)  # without a relaunch: 1 of 3 left, a lone group
            assert len(before.rollouts) == 1 and list(before.skipped.values()) == ["infrastructure"] * 2

            watch = StatusWatch(store, run_id)  # the resumed trainer
            await watch.start(await store.last_sequence())
            await watch.adopt(group.rollout_ids)
            agents = asyncio.create_task(_play_relaunched(admin, run_id, 2))
            try:
                in_flight, ended = await asyncio.wait_for(
                    wait_relaunching(watch, store, gateway, run_id, 2, [group], 1, set(group.rollout_ids),
                                     lambda task: {"q": task}),
                    60,
                )  # fmt: skip
                relaunched = await agents
            finally:
                await watch.stop()
        finally:
            await admin.aclose()
            await gateway.close()
    (resumed,) = ended
    assert in_flight == [resumed]
    assert resumed.rollout_ids == [group.rollout_ids[0], *(f"{r}-relaunched" for r in group.rollout_ids[1:])]
    assert all(r["input"] == {"q": 0} and r["group_id"] == group.group_id for r in relaunched)
    replayed = await replay_group(store, run_id, resumed)
    assert replayed.skipped == {} and sorted(r.reward or 0.0 for r in replayed.rollouts) == [0.0, 0.0, 1.0]
