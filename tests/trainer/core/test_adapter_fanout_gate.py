"""A fan-out that straddles a weight update (async mode) is not deduped: a real gateway's phase gate
holds one twin while the other finishes, and the adapter must still see them as concurrent.

The upstream is the fake vLLM of the gateway tests (vLLM's response format, see its docstring); the
gateway and NATS are real, the agent the official `openai` SDK.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import openai

from schemas import ModelRequestRecorded
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.gateway import create_app
from trainer.core import call_from_event, dedup_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "services" / "gateway"))
from fake_vllm import FakeVLLM
from gw_harness import ADMIN, GatewayHandle, Served, gateway_settings

RUN = "fanout-gate"
CHAT: Any = {"model": "fake", "messages": [{"role": "user", "content": "one task, two workers"}], "max_tokens": 3}


async def _twins_across_an_update(gw: GatewayHandle, fake: FakeVLLM) -> str:
    """Twin A runs; the update closes the gate; twin B, sent while A still runs, is held until the
    rollout phase opens again, long after A ended. Returns the rollout id."""
    rollout, attempt = gw.running(RUN, fake.url)
    agent: Any = openai.AsyncOpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    admin = httpx.AsyncClient(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    try:
        fake.delay_s = 0.8
        first = asyncio.ensure_future(agent.chat.completions.create(**CHAT))
        while fake.started < 1:
            await asyncio.sleep(0.01)
        update = asyncio.ensure_future(admin.post("/api/phase", json={"run_id": RUN, "phase": "update"}))
        while gw.gw.gate.is_open(RUN):
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(agent.chat.completions.create(**CHAT))
        assert (await update).status_code == 200 and first.done()
        await asyncio.sleep(0.3)  # the update itself
        assert not second.done()
        fake.delay_s = 0.0
        released = await admin.post("/api/phase", json={"run_id": RUN, "phase": "rollout", "weights_version": 8})
        assert released.status_code == 200, released.text
        await second
    finally:
        await agent.close()
        await admin.aclose()
    return str(rollout["rollout_id"])


async def test_twins_held_at_the_update_gate_are_a_fan_out_not_a_retry(fresh_nats: NatsServer) -> None:
    fake = FakeVLLM()
    settings = gateway_settings(fresh_nats.url)
    with Served(fake) as upstream:
        fake.url = upstream.url
        with Served(create_app(settings), settings.port) as served:
            gw = GatewayHandle(served, settings)
            rollout_id = await _twins_across_an_update(gw, fake)
            gw.admin.close()
    store = await EventStore.connect(fresh_nats.url)
    try:
        stored = await store.read_rollout(RUN, rollout_id)
    finally:
        await store.close()
    calls = [call_from_event(s.event) for s in stored if isinstance(s.event, ModelRequestRecorded)]
    assert len(calls) == 2 and list(calls[0].prompt_ids) == list(calls[1].prompt_ids)
    assert calls[1].started_at is not None and calls[0].ended_at is not None
    assert calls[1].started_at < calls[0].ended_at, "the held twin was sent while the first still ran"
    assert dedup_calls(calls) == calls
