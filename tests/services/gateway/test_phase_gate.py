"""The collocated-async phase gate with calls in flight, and what happens when NATS goes away."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
from fake_vllm import FakeVLLM
from gw_harness import ADMIN, GatewayHandle, Served, gateway_settings

from services.devstack.embedded import NatsServer
from services.gateway import create_app

CHAT: Any = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_update_waits_for_in_flight_calls_and_holds_new_ones(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    fake_vllm.delay_s = 0.6
    agent: Any = openai.AsyncOpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    admin = httpx.AsyncClient(base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    in_flight = [asyncio.ensure_future(agent.chat.completions.create(**CHAT)) for _ in range(3)]
    while fake_vllm.started < 3:
        await asyncio.sleep(0.01)
    began = time.monotonic()
    update = await admin.post("/api/phase", json={"run_id": run_id, "phase": "update"})
    waited = time.monotonic() - began
    assert update.status_code == 200, update.text
    assert all(call.done() and call.exception() is None for call in in_flight), "update returned before the drain"
    assert waited > 0.3
    recorded = gateway.admin.get(f"/api/rollouts/{rollout['rollout_id']}/events", params={"type": "model_request"})
    assert len(recorded.json()) == 3 and max(e["seq"] for e in recorded.json()) < update.json()["seq"]

    fake_vllm.delay_s = 0.0
    started = fake_vllm.started
    held = asyncio.ensure_future(agent.chat.completions.create(**CHAT))
    await asyncio.sleep(0.4)
    assert not held.done() and fake_vllm.started == started, "a call was forwarded during the update phase"
    release = await admin.post("/api/phase", json={"run_id": run_id, "phase": "rollout", "weights_version": 8})
    assert release.status_code == 200 and release.json()["weights_version"] == 8
    answer = await asyncio.wait_for(held, 5)
    assert answer.choices[0].message.content
    phases = [e.event for e in [s async for s in gateway_store_read(gateway, f"rl.{run_id}.phase")]]
    assert [(p.phase, p.weights_version) for p in phases] == [("update", None), ("rollout", 8)]

    # a run held longer than the hold timeout answers 503 with Retry-After (the harness may retry)
    gateway.gw.gate.hold_timeout_s = 0.3
    try:
        assert (await admin.post("/api/phase", json={"run_id": run_id, "phase": "update"})).status_code == 200
        raw = await httpx.AsyncClient().post(
            attempt["proxy_base_url"] + "/chat/completions",
            json=CHAT,
            headers={"authorization": f"Bearer {attempt['token']}"},
        )
        assert raw.status_code == 503 and raw.headers["retry-after"]
    finally:
        gateway.gw.gate.hold_timeout_s = gateway.settings.phase_hold_timeout_s
        await admin.post("/api/phase", json={"run_id": run_id, "phase": "rollout"})
    await agent.close()
    await admin.aclose()


async def gateway_store_read(gateway: GatewayHandle, subject: str):  # type: ignore[no-untyped-def]
    """Read events through a store of this test's own loop."""
    from services.common.eventstore import EventStore

    store = await EventStore.connect(gateway.settings.nats_url)
    try:
        async for stored in store.read(subject):
            yield stored
    finally:
        await store.close()


def test_nats_down_is_503_and_nothing_is_forwarded(fresh_nats: NatsServer, fake_vllm: FakeVLLM, run_id: str) -> None:
    settings = gateway_settings(fresh_nats.url)
    with Served(create_app(settings), settings.port) as served:
        gateway = GatewayHandle(served, settings)
        _, attempt = gateway.running(run_id, fake_vllm.url)
        headers = {"authorization": f"Bearer {attempt['token']}"}
        chat = attempt["proxy_base_url"] + "/chat/completions"
        assert httpx.post(chat, json=CHAT, headers=headers).status_code == 200
        fresh_nats.stop()
        deadline = time.monotonic() + 5
        while gateway.gw.store.nc.is_connected and time.monotonic() < deadline:
            time.sleep(0.05)
        started = fake_vllm.started
        down = httpx.post(chat, json=CHAT, headers=headers)
        assert down.status_code == 503 and int(down.headers["retry-after"]) > 0, down.text
        assert fake_vllm.started == started
        create = gateway.admin.post("/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": 1}]})
        assert create.status_code == 503 and create.headers["retry-after"]
        listing = gateway.admin.get("/api/rollouts", params={"run_id": run_id})
        assert listing.status_code == 503, listing.text
        health = httpx.get(gateway.url + "/healthz")
        assert health.status_code == 503 and health.json() == {"status": "degraded", "nats": False}
        gateway.admin.close()
