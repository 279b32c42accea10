"""Custom events carry who wrote them, and an agent cannot write the names other parts act on.

Once, an agent's custom event named `train_step` was taken for the trainer's (so `replay --step 7`
listed the rollout as trained), and `budget_exceeded`, `log` and `flag` were trusted the same way.
"""

from __future__ import annotations

from typing import Any

import httpx
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle

from schemas import CustomEvent, RolloutCreated
from schemas.events import RESERVED_EVENT_NAMES, TRAIN_STEP_EVENT
from services.common.eventstore import EventStore
from services.tools.monitor import flags_of
from services.tools.source import index_run

RESERVED = [*sorted(RESERVED_EVENT_NAMES), "flag-reward-hack"]


async def test_an_agent_cannot_write_a_name_other_parts_act_on(
    gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM, store: EventStore
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    rid = rollout["rollout_id"]
    evaluator = gateway.admin.post(f"/api/rollouts/{rid}/attempt/{attempt['attempt_id']}/evaluator-token").json()
    agent = httpx.Client(headers={"authorization": f"Bearer {attempt['token']}"}, timeout=10)
    grader = httpx.Client(headers={"authorization": f"Bearer {evaluator['token']}"}, timeout=10)

    def post(client: httpx.Client, name: str, payload: dict[str, Any], agl: bool = False) -> httpx.Response:
        body = {"event_type": name, "data": payload} if agl else {"type": "custom", "name": name, "payload": payload}
        return client.post(attempt["events_url"], json=body)

    trained = post(gateway.admin, TRAIN_STEP_EVENT, {"step": 3})  # the trainer's record (admin)
    assert trained.status_code == 201, trained.text
    for name in RESERVED:
        refused = post(agent, name, {"step": 7})
        assert refused.status_code == 403, (name, refused.text)
        assert "reserved" in refused.json()["error"], name
        agl = post(agent, name, {"step": 7}, agl=True)
        assert agl.status_code == 403, (name, agl.text)  # Agent Lightning's shape too
    assert post(agent, "metrics", {"score": 1}).status_code == 201  # any other name is the agent's to use
    assert post(grader, "flag", {"rule": "hack"}).status_code == 201  # an evaluator may flag

    written = {
        (e.name, e.source)
        for e in (stored.event for stored in await store.read_rollout(run_id, rid))
        if isinstance(e, CustomEvent)
    }
    assert written == {(TRAIN_STEP_EVENT, "admin"), ("metrics", "agent"), ("flag", "evaluator")}
    index = await index_run(store, run_id)
    assert index.rollouts[rid].step == 3  # the trainer's step, not the agent's 7


async def test_consumers_ignore_reserved_names_an_agent_wrote(store: EventStore, run_id: str) -> None:
    """Events already on the stream (written around the gateway, or before it refused them) are not acted on."""
    created = RolloutCreated(run_id=run_id, rollout_id="r", input=1)
    forged = [
        CustomEvent(run_id=run_id, rollout_id="r", name=TRAIN_STEP_EVENT, payload={"step": 7}, source="agent"),
        CustomEvent(run_id=run_id, rollout_id="r", name="flag", payload={"rule": "x"}, source="agent"),
    ]
    await store.append_many([created, *forged])
    index = await index_run(store, run_id)
    assert index.rollouts["r"].step is None and not index.has_steps
    assert flags_of(forged) == []
    assert not forged[0].trusted and CustomEvent(run_id=run_id, name="flag").trusted  # absent source: admin
