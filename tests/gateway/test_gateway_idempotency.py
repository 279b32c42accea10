"""Idempotent creation forever (issue: a late retry resurrected a finished rollout).

A create without `rollout_id` and with key K, run to `succeeded`; the gateway restarted and
JetStream's duplicate window long past; the same create again must answer the original rollout,
append no second `created` and leave it `succeeded`. "Past the window" is reproduced exactly by
writing the original events without a message id, so JetStream has no record to deduplicate
against; "restarted" by a gateway whose cache never saw K.
"""

from __future__ import annotations

from gw_harness import GatewayHandle

from schemas import RolloutCreated, RolloutStatusChanged, encode
from services.gateway.idempotency import derive_id


async def test_late_retry_answers_the_finished_rollout(gateway: GatewayHandle, run_id: str) -> None:
    key = f"late-{run_id}"
    rollout_id = derive_id(key, "rollout", "0")
    created = RolloutCreated(run_id=run_id, rollout_id=rollout_id, input={"q": 1})
    history = [
        created,
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, status="queuing"),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, status="running", previous="queuing"),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, status="succeeded", previous="running"),
    ]
    store = gateway.gw.store
    for event in history:
        await store.js.publish(event.subject, encode(event), stream=store.stream)  # no Nats-Msg-Id
    retry = gateway.admin.post(
        "/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": {"q": 1}}]}, headers={"idempotency-key": key}
    )
    assert retry.status_code == 201, retry.text
    answered = retry.json()["rollouts"][0]
    assert answered["rollout_id"] == rollout_id and answered["status"]["state"] == "succeeded"
    events = gateway.admin.get(
        f"/api/rollouts/{rollout_id}/events", params={"type": "rollout.created,rollout.status"}
    ).json()
    assert [e["type"] for e in events].count("rollout.created") == 1
    assert [e["status"] for e in events if e["type"] == "rollout.status"][-1] == "succeeded"
