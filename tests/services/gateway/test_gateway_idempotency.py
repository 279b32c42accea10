"""Idempotent creation forever (issue: a late retry resurrected a finished rollout), and keyed events
stored once whatever the time and the gateway that serves the retry.

A create without `rollout_id` and with key K, run to `succeeded`; the gateway restarted and
JetStream's duplicate window long past; the same create again must answer the original rollout,
append no second `created` and leave it `succeeded`. "Past the window" is reproduced exactly by
writing the original events without a message id, so JetStream has no record to deduplicate
against; "restarted" by a gateway whose cache never saw K.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import httpx
from gw_harness import GatewayHandle, Served, gateway_settings

from schemas import CustomEvent, RewardReported, RolloutCreated, RolloutStatusChanged, encode
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.gateway import create_app
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


async def test_a_keyed_event_retried_past_the_window_through_a_restarted_gateway_is_stored_once(
    fresh_nats: NatsServer, run_id: str
) -> None:
    """A reward (and a custom event) posted with a key, the gateway restarted, JetStream's duplicate window
    passed (shortened to 1 s, then waited out): the same post again answers the first event and appends
    nothing. Once, each was appended twice."""
    settings = gateway_settings(fresh_nats.url)
    with Served(create_app(settings), settings.port) as served:
        handle = GatewayHandle(served, settings)
        rollout = handle.create(run_id)[0]
        attempt = handle.attempt(rollout["rollout_id"])
        path = urlsplit(attempt["events_url"]).path
        agent = {"authorization": f"Bearer {attempt['token']}"}
        bodies: list[dict[str, Any]] = [
            {"type": "reward", "value": 0.5},
            {"type": "custom", "name": "note", "payload": {"n": 1}},
        ]
        answers = _post_keyed(f"{served.url}{path}", agent, bodies)
        assert [a.status_code for a in answers] == [201, 201], [a.text for a in answers]
        handle.admin.close()
    store = await EventStore.connect(fresh_nats.url)
    try:
        await _expire_duplicates(store)
        restarted = gateway_settings(fresh_nats.url)
        with Served(create_app(restarted), restarted.port) as again:
            retries = _post_keyed(f"{again.url}{path}", agent, bodies)
        for retry, answer in zip(retries, answers, strict=True):
            assert retry.status_code == 201, retry.text
            assert retry.json() == answer.json()  # the first answer, seq included
        stored = await store.read_rollout(run_id, rollout["rollout_id"])
        assert sum(isinstance(s.event, RewardReported) for s in stored) == 1
        assert sum(isinstance(s.event, CustomEvent) for s in stored) == 1
    finally:
        await store.close()


def _post_keyed(url: str, headers: dict[str, str], bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """Each body posted with its own key (`k0`, `k1`, ...)."""
    return [
        httpx.post(url, json=body, headers={**headers, "idempotency-key": f"k{i}"}, timeout=10)
        for i, body in enumerate(bodies)
    ]


async def _expire_duplicates(store: EventStore) -> None:
    """Make JetStream forget every message id: its duplicate window shortened to 1 s and waited out."""
    info = await store.js.stream_info(store.stream)
    config = info.config
    config.duplicate_window = 1.0
    await store.js.update_stream(config)
    await asyncio.sleep(3)
