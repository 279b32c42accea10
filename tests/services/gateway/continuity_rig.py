"""Shared parts of the continuous prompt mode tests: the scripted model, the 6-turn harness, counting samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from gw_harness import GatewayHandle
from template_vllm import TemplateVLLM, qwen3_style_dir

from schemas import ModelRequestRecorded
from services.common.tinymodel.build import build_tiny_model
from services.common.tinymodel.tokenizer import load_tokenizer
from trainer.core.merge import merge_calls
from trainer.core.recorded import call_from_event

ARGUMENTS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS: Any = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ARGUMENTS}}]
TURNS = 6


def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with a Qwen3-style chat template, in a fresh directory."""
    tiny = build_tiny_model(tmp_path_factory.mktemp("cont-tiny"), seed=0)
    return qwen3_style_dir(tiny, tmp_path_factory.mktemp("qwen3-style"))


def scripted_engine(model_dir: Path) -> TemplateVLLM:
    """The template fake answering `answer_text(turn)` + the end-of-turn token."""
    tokenizer = load_tokenizer(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return TemplateVLLM(model_dir, lambda turn: [*tokenizer.encode(answer_text(turn), add_special_tokens=False), end])


def answer_text(turn: int) -> str:
    """What the model 'samples' at a turn: reasoning, then a tool call with its own JSON spacing, or the answer."""
    if turn < TURNS - 1:
        return f'<think>\nstep {turn}: add again\n</think>\n\n<tool_call>\n{{"name": "add", "arguments": {{"b":  2, "a": {turn}}}}}\n</tool_call>'  # noqa: E501
    return "<think>\nall done\n</think>\n\nThe sum is 12."


def start(gateway: GatewayHandle, run_id: str, mode: str, engine: TemplateVLLM, model_dir: Path, **model: Any) -> Any:
    """A run in `mode` with the fake registered; a rollout's attempt, and an openai client on its proxy URL."""
    r = gateway.admin.post("/api/runs", json={"run_id": run_id, "prompt_mode": mode})
    assert r.status_code in (200, 201), r.text
    extra = {"tokenizer": str(model_dir), "reasoning_parser": "qwen3", **model}
    gateway.register_model(run_id, f"{engine.url}/v1", name="policy", served_model="qwen3-style", **extra)  # type: ignore[attr-defined]
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    client = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    return rollout["rollout_id"], client


def tool_loop(*clients: openai.OpenAI, compact_at: int | None = None, stream: bool = False) -> list[Any]:
    """The 6-turn harness: call, run each tool call, send the results back, until a text answer.

    With several clients (gateway replicas) the calls go to each in turn."""
    messages: list[Any] = [{"role": "system", "content": "You add."}, {"role": "user", "content": "Add 2 five times."}]
    for turn in range(TURNS):
        client = clients[turn % len(clients)]
        if turn == compact_at:  # a compacting harness: keeps the task and the last exchange only
            messages = messages[:2] + messages[-2:]
        if stream:
            chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True))
            message = _from_stream(chunks)
        else:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        for call in message.get("tool_calls") or []:
            arguments = msgspec.json.decode(call["function"]["arguments"])
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": str(arguments["a"] + arguments["b"])}
            )
        if not message.get("tool_calls"):
            break
    return messages


def _from_stream(chunks: list[Any]) -> dict[str, Any]:
    content, calls = "", []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [c.model_dump(exclude_none=True) for c in choice.delta.tool_calls or []]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return message


def recorded(gateway: GatewayHandle, rollout_id: str) -> list[ModelRequestRecorded]:
    """The rollout's model calls as recorded (full prompts)."""
    items = gateway.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": "model_request"}).json()
    return [msgspec.convert(item, ModelRequestRecorded) for item in items]


def sample_count(calls: list[ModelRequestRecorded], rollout_id: str) -> int:
    """Samples the trainer's exact merge makes of the calls."""
    return len(merge_calls([call_from_event(c) for c in calls], rollout_id=rollout_id, group_id=None).samples)
