"""A store that refuses writes for lack of room: appends fail fast with `StoreFull`, the gateway's
`/healthz` turns red saying why, and model calls are refused before anything is generated until a
write succeeds again.

The store is filled for real: a nats-server of the test's own whose stream gets a small
`max_bytes` with the `new` discard policy, so JetStream answers "maximum bytes exceeded"
(code 10077), as it answers "insufficient resources" (10023) when the server's own storage limit is
reached. Before: `append_many` waited out its 30 s ack timeout (nats-py's `publish_async` never
completes a refused publish), `/healthz` stayed 200, and each model call failed with a 500 after the
engine had generated it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle, Served, gateway_settings
from nats.js.api import DiscardPolicy

from schemas import CustomEvent
from services.common.eventstore import EventStore, StoreFull
from services.devstack.embedded import NatsServer
from services.gateway import create_app

HI = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _limit(url: str, max_bytes: int) -> None:
    """Give the stream a byte limit (-1: none) past which JetStream refuses new events."""
    store = await EventStore.connect(url, ensure=False)
    try:
        config = (await store.js.stream_info(store.stream)).config
        config.max_bytes = max_bytes
        config.discard = DiscardPolicy.NEW
        await store.js.update_stream(config)
    finally:
        await store.close()


def _events(run_id: str, n: int, size: int) -> list[CustomEvent]:
    return [
        CustomEvent(run_id=run_id, rollout_id="r", attempt_id="a", name="blob", payload={"x": "y" * size})
        for _ in range(n)
    ]


async def test_append_many_fails_fast_on_a_full_store(fresh_nats: NatsServer) -> None:
    store = await EventStore.connect(fresh_nats.url)
    try:
        await _limit(fresh_nats.url, 20_000)
        started = time.monotonic()
        with pytest.raises(StoreFull) as refused:
            await store.append_many(_events("full", 40, 1000))
        took = time.monotonic() - started
        assert refused.value.code == 10077 and "maximum bytes" in str(refused.value)
        assert store.refusing is not None
        with pytest.raises(StoreFull):
            await store.append(_events("full", 1, 1000)[0])
        await _limit(fresh_nats.url, -1)
        await store.append_many(_events("full", 2, 10))
        assert store.refusing is None  # a write that succeeds clears it
        print(f"\nappend_many on a full stream: refused after {took:.2f}s (was 30 s, the ack timeout)")
        assert took < 5
    finally:
        await store.close()


def _call(attempt: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {attempt['token']}"}
    return httpx.post(f"{attempt['proxy_base_url']}/chat/completions", json=HI, headers=headers, timeout=30)


def test_a_full_store_turns_healthz_red_and_refuses_calls_before_generation(
    fresh_nats: NatsServer, fake_vllm: FakeVLLM, run_id: str
) -> None:
    settings = gateway_settings(fresh_nats.url)
    with Served(create_app(settings), settings.port) as served:
        gateway = GatewayHandle(served, settings)
        _, attempt = gateway.running(run_id, fake_vllm.url)
        assert _call(attempt).status_code == 200
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
        asyncio.run(_limit(fresh_nats.url, 64_000))
        agent = {"authorization": f"Bearer {attempt['token']}"}
        answers = []
        for _ in range(200):  # an agent's custom events fill the store
            posted = httpx.post(attempt["events_url"], headers=agent, timeout=30,
                                json={"type": "custom", "name": "blob", "payload": {"x": "y" * 4000}})  # fmt: skip
            answers.append(posted.status_code)
            if posted.status_code != 201:
                break
        assert answers[-1] == 503, answers
        assert "full" in posted.json()["error"]
        health = httpx.get(f"{gateway.url}/healthz")
        assert health.status_code == 503, health.text
        assert health.json()["store"] == "refusing writes" and "maximum bytes" in health.json()["reason"]
        generated = len(fake_vllm.requests)
        refused = _call(attempt)
        assert refused.status_code == 503, refused.text
        assert "nothing was generated" in refused.json()["error"]["message"]
        assert len(fake_vllm.requests) == generated, "the engine generated a call the store could not keep"
        asyncio.run(_limit(fresh_nats.url, -1))  # room again: the next refused call's record succeeds
        again = [_call(attempt).status_code for _ in range(3)]
        assert again[-1] == 200, again
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
        gateway.admin.close()
