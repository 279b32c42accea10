"""Continuous prompt mode: prompts built from the sampled tokens, so a linear rollout is one sample.

Through the real gateway and the official `openai` client, against a fake vLLM that renders chat
requests with a Qwen3-style template (it drops earlier turns' reasoning and re-serialises tool-call
JSON) and answers token-in completions from the ids it is given (`template_vllm.py`). The same
scripted 6-turn tool loop runs in a run of each prompt mode; the trainer's exact merge then counts
samples per rollout.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from gw_harness import GatewayHandle, Served, gateway_settings
from template_vllm import TemplateVLLM, qwen3_style_dir

pytest.importorskip("transformers", reason="the tiny model's tokenizer needs transformers (pip install -e .[train])")

from schemas import ModelRequestRecorded
from services.engine.tiny_model import build_tiny_model
from services.engine.tokenizer import load_tokenizer
from services.gateway import create_app
from trainer.core.calls import call_from_event
from trainer.core.merge import merge_calls

ARGUMENTS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS: Any = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ARGUMENTS}}]
TURNS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with a Qwen3-style chat template."""
    tiny = build_tiny_model(tmp_path_factory.mktemp("cont-tiny"), seed=0)
    return qwen3_style_dir(tiny, tmp_path_factory.mktemp("qwen3-style"))


def answer_text(turn: int) -> str:
    """What the model 'samples' at a turn: reasoning, then a tool call with its own JSON spacing, or the answer."""
    if turn < TURNS - 1:
        return f'<think>\nstep {turn}: add again\n</think>\n\n<tool_call>\n{{"name": "add", "arguments": {{"b":  2, "a": {turn}}}}}\n</tool_call>'  # noqa: E501
    return "<think>\nall done\n</think>\n\nThe sum is 12."


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TemplateVLLM]:
    """The template-rendering fake vLLM, answering `answer_text(turn)` + the end-of-turn token."""
    tokenizer = load_tokenizer(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def script(turn: int) -> list[int]:
        return [*tokenizer.encode(answer_text(turn), add_special_tokens=False), end]

    app = TemplateVLLM(model_dir, script)
    with Served(app) as served:
        app.url = served.url  # type: ignore[attr-defined]
        yield app


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


def test_a_six_turn_tool_loop_is_one_sample_in_continuous_mode_and_splits_in_exact(
    gateway: GatewayHandle, engine: TemplateVLLM, model_dir: Path, run_id: str
) -> None:
    """Exact mode re-renders (reasoning dropped, JSON re-serialised) and splits; continuous keeps the sampled ids."""
    counts = {}
    for mode in ("exact", "continuous"):
        rollout_id, client = start(gateway, f"{run_id}-{mode}", mode, engine, model_dir)
        messages = tool_loop(client)
        assert messages[-1]["content"] == "\n\nThe sum is 12."
        calls = recorded(gateway, rollout_id)
        assert len(calls) == TURNS and all(c.status == "ok" for c in calls)
        counts[mode] = sample_count(calls, rollout_id)
        if mode == "continuous":
            assert [c.continuity for c in calls] == ["fresh: first call of the attempt"] + ["extended"] * (TURNS - 1)
            for earlier, later in itertools.pairwise(calls):
                assert later.prompt_ids[: len(earlier.prompt_ids) + len(earlier.response_ids)] == [
                    *earlier.prompt_ids, *earlier.response_ids
                ]  # fmt: skip
            assert calls[1].response["message"]["reasoning_content"] == "\nstep 1: add again\n"
        else:
            assert not any(c.continuity for c in calls)
    assert counts == {"exact": TURNS, "continuous": 1}


def test_a_streamed_loop_extends_too_and_the_stream_adds_up(
    gateway: GatewayHandle, engine: TemplateVLLM, model_dir: Path, run_id: str
) -> None:
    """Streamed calls are converted chunk by chunk: the harness rebuilds the same tool calls and text."""
    rollout_id, client = start(gateway, run_id, "continuous", engine, model_dir)
    messages = tool_loop(client, stream=True)
    assert messages[-1]["content"] == "\n\nThe sum is 12."
    calls = recorded(gateway, rollout_id)
    assert [c.continuity for c in calls][1:] == ["extended"] * (TURNS - 1)
    assert sample_count(calls, rollout_id) == 1


def test_a_compacting_harness_starts_a_second_chain_and_says_why(
    gateway: GatewayHandle, engine: TemplateVLLM, model_dir: Path, run_id: str
) -> None:
    """Dropping old turns at turn 4: that call is rendered fresh, with the reason; the rest extend it."""
    rollout_id, client = start(gateway, run_id, "continuous", engine, model_dir)
    tool_loop(client, compact_at=4)
    calls = recorded(gateway, rollout_id)
    kinds = [c.continuity for c in calls]
    assert kinds[:4] == ["fresh: first call of the attempt", "extended", "extended", "extended"]
    assert kinds[4] == "fresh: history differs from every earlier call at message 2"
    assert kinds[5] == "extended"
    assert sample_count(calls, rollout_id) == 2


@pytest.fixture
def second(nats_url: str) -> Iterator[GatewayHandle]:
    """Another gateway replica on the same NATS (its own call cache)."""
    settings = gateway_settings(nats_url)
    with Served(create_app(settings), settings.port) as served:
        handle = GatewayHandle(served, settings)
        yield handle
        handle.admin.close()


def test_calls_alternating_between_two_gateways_extend_one_chain(
    gateway: GatewayHandle, second: GatewayHandle, engine: TemplateVLLM, model_dir: Path, run_id: str
) -> None:
    """Round-robin over two replicas: each finds the other's calls on the stream, the chain holds."""
    rollout_id, client = start(gateway, run_id, "continuous", engine, model_dir)
    other = openai.OpenAI(
        base_url=str(client.base_url).replace(gateway.url, second.url), api_key=client.api_key, max_retries=0
    )
    tool_loop(client, other)
    calls = recorded(gateway, rollout_id)
    assert len(calls) == TURNS
    assert [c.continuity for c in calls][1:] == ["extended"] * (TURNS - 1)
    assert sample_count(calls, rollout_id) == 1
