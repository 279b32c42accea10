"""A call answered 503 "retry it" during a NATS outage is never stored later.

nats-py keeps what is published while disconnected (and what was queued but unsent when the
connection dropped) in a reconnect buffer and sends it once NATS is back; a call record buffered
that way was stored `ok` after the agent had been told it was not recorded (1 such record here
before, 0 after). The gateway's connection now has no reconnect buffer: the record fails at once
and is never sent. nats-server is killed for real while the engine is generating the call.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import httpx
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle, Served, gateway_settings

from schemas import ModelRequestRecorded
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.gateway import create_app


def _recorded(url: str, run_id: str) -> list[ModelRequestRecorded]:
    async def read() -> list[ModelRequestRecorded]:
        store = await EventStore.connect(url, ensure=False)
        try:
            return [s.event async for s in store.read(f"rl.{run_id}.rollout.*.model_request")]  # type: ignore[misc]
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_call_answered_503_in_an_outage_is_not_stored_after_it(
    fresh_nats: NatsServer, fake_vllm: FakeVLLM, run_id: str
) -> None:
    settings = gateway_settings(fresh_nats.url)
    with Served(create_app(settings), settings.port) as served:
        gateway = GatewayHandle(served, settings)
        _, attempt = gateway.running(run_id, fake_vllm.url)
        fake_vllm.delay_s = 1.5  # NATS dies while the engine generates
        answer: list[httpx.Response] = []

        def call() -> None:
            body = {"model": "fake", "messages": [{"role": "user", "content": "in the outage"}], "max_tokens": 3}
            headers = {"authorization": f"Bearer {attempt['token']}"}
            answer.append(httpx.post(f"{attempt['proxy_base_url']}/chat/completions", json=body, headers=headers,
                                     timeout=60))  # fmt: skip

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.5)
        assert fresh_nats.proc is not None
        fresh_nats.proc.send_signal(signal.SIGKILL)
        fresh_nats.proc.wait()
        fresh_nats.proc = None
        caller.join(60)
        assert answer[0].status_code == 503, answer[0].text
        message: str = answer[0].json()["error"]["message"]
        assert "retry" in message and "not stored" in message, message
        fresh_nats.start()
        deadline = time.monotonic() + 20
        while httpx.get(f"{gateway.url}/healthz").status_code != 200:
            assert time.monotonic() < deadline, "the gateway did not reconnect"
            time.sleep(0.1)
        time.sleep(1.0)  # a buffered record would be flushed right after the reconnect
        gateway.admin.close()
    calls: list[Any] = _recorded(fresh_nats.url, run_id)
    stored = [c for c in calls if c.request.get("messages", [{}])[0].get("content") == "in the outage"]
    print(f"\nrecords stored after a 503 'not recorded' answer: {len(stored)} (was 1)")
    assert stored == []
