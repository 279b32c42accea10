"""The viewer's timeline of calls recorded by a real gateway: tool calls, reply text without a tokenizer,
and the prompt of a call that starts a new conversation with as many messages as the previous call.

The upstream is the fake vLLM of the gateway tests (vLLM's response format, see its docstring); the
gateway, NATS, the projector and Postgres are the real services, the client the official `openai` SDK.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
from projector_support import running_projector, wait_applied

from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.gateway import create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle, Served, gateway_settings
from test_viewer import TOKEN, viewer_app

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def _calls_through_gateway(nats_url: str) -> tuple[str, str]:
    """A tool round trip, then a new conversation of the same length, through the proxy: (run, rollout)."""
    fake = FakeVLLM()
    with Served(fake) as upstream:
        settings = gateway_settings(nats_url)
        with Served(create_app(settings), settings.port) as served:
            gw = GatewayHandle(served, settings)
            rollout, attempt = gw.running("viewer-tools", upstream.url)
            client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
            first = [{"role": "user", "content": "add two and three"}]
            reply = client.chat.completions.create(model="m", messages=first, tools=TOOLS, max_tokens=6)
            call = reply.choices[0].message.tool_calls[0]
            second = [
                *first,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "5"},
            ]
            client.chat.completions.create(model="m", messages=second, tools=TOOLS, max_tokens=6)
            fresh = [{"role": "user", "content": f"another task {i}"} for i in range(3)]
            client.chat.completions.create(model="m", messages=fresh, max_tokens=6)
            gw.admin.close()
    return "viewer-tools", rollout["rollout_id"]


async def test_timeline_shows_tool_calls_reply_text_and_new_conversations(
    fresh_nats: NatsServer, database: str
) -> None:
    run, rollout = _calls_through_gateway(fresh_nats.url)
    store = await EventStore.connect(fresh_nats.url)
    conn = await asyncpg.connect(database)
    try:
        async with running_projector(fresh_nats.url, database):  # no tokenizer for the fake model
            await wait_applied(conn, await store.last_sequence())
    finally:
        await conn.close()
        await store.close()
    transport = httpx.ASGITransport(app=viewer_app(database))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://viewer", headers=auth) as client:
        timeline = (await client.get(f"/ui/api/runs/{run}/rollouts/{rollout}/timeline")).json()
    calls = [e for e in timeline["events"] if e["type"] == "model_request"]
    assert len(calls) == 3
    tool = calls[0]["tool_calls"]
    assert len(tool) == 1 and tool[0]["name"] == "add" and tool[0]["arguments"].startswith("{"), tool
    assert calls[0]["tool_calls"][0]["id"].startswith("call_")
    assert calls[1]["response_text"] and calls[1]["response_pieces"] is None, calls[1]
    assert [m["role"] for m in calls[1]["new_messages"]] == ["assistant", "tool"]
    assert [m["content"] for m in calls[2]["new_messages"]] == [f"another task {i}" for i in range(3)]
