"""Through the real gateway: a multi-turn conversation is recorded as references plus what is new,
and every read (the rollout's events, typed reads) gives back each call's full prompt and request."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import openai
from fake_vllm import FakeVLLM, prompt_ids
from gw_harness import GatewayHandle

from schemas import SCHEMA_VERSION
from services.common.eventstore import EventStore

SYSTEM = {"role": "system", "content": "you are a careful agent " * 20}


def _raw_calls(nats_url: str, run_id: str, rollout_id: str) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        store = await EventStore.connect(nats_url, ensure=False)
        try:
            subject = f"rl.{run_id}.rollout.{rollout_id}.model_request"
            return [json.loads(m.data) async for batch in store.read_raw(subject) for m in batch]
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_conversation_is_recorded_once_and_read_back_whole(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, nats_url: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "list the files"}]
    sent = []
    for turn in range(5):
        sent.append(list(messages))
        if turn % 2:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(model="fake", messages=messages, max_tokens=8, stream=True)
                if c.choices
            )
        else:
            text = (
                client.chat.completions.create(model="fake", messages=messages, max_tokens=8).choices[0].message.content
            )
        messages = [*messages, {"role": "assistant", "content": text}, {"role": "tool", "content": f"out {turn} " * 30}]
    raw = _raw_calls(nats_url, run_id, rollout["rollout_id"])
    assert [c["schema_version"] for c in raw] == [SCHEMA_VERSION] * 5
    assert "prompt_ref" not in raw[0] and all("prompt_ref" in c for c in raw[1:])
    for earlier, call in itertools.pairwise(raw):
        ref = call["prompt_ref"]
        assert ref["event_id"] == earlier["event_id"] and ref["seq"] > 0
        assert ref["prefix"] == {"messages": len(sent[raw.index(earlier)])}
        assert len(call["request"]["messages"]) == 2 and "model" in ref["same"]
        assert call["packed"]["prompt"] and not {"prompt_ids", "response_ids", "logprobs"} & call.keys()
    head = prompt_ids([SYSTEM])  # the engine is shared: keep what it served for this conversation
    served = [c for c in fake_vllm.served if c["prompt_ids"][: len(head)] == head]
    events = gateway.admin.get(f"/api/rollouts/{rollout['rollout_id']}/events", params={"type": "model_request"}).json()
    assert [e["prompt_ids"] for e in events] == [s["prompt_ids"] for s in served]
    assert [e["response_ids"] for e in events] == [s["token_ids"] for s in served]
    assert [e["request"]["messages"] for e in events] == sent
    whole = sum(len(json.dumps(e)) for e in events)
    assert sum(len(json.dumps(c)) for c in raw) < whole / 2
