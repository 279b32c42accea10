"""Continuous prompt mode across front ends and engines: Messages and Responses tool loops, byte-level
drift kept exact, and the session's real vLLM server (`tests/vllm_server.py`) over the real `openai` client."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import anthropic
import openai
import pytest
from continuity_rig import TURNS, recorded, sample_count, start
from gw_harness import GatewayHandle, Served
from template_vllm import TemplateVLLM
from vllm_server import VllmServer

from services.common.tinymodel.tokenizer import load_tokenizer

ANTHROPIC_TOOLS: Any = [{"name": "add", "description": "a + b", "input_schema": {"type": "object"}}]
RESPONSES_TOOLS: Any = [{"type": "function", "name": "add", "description": "a + b", "parameters": {"type": "object"}}]


def test_a_messages_api_tool_loop_is_one_sample(
    gateway: GatewayHandle,
    qwen3_vllm: TemplateVLLM,
    qwen3_model_dir: Path,
    run_id: str,
) -> None:
    """Anthropic's client: tool_use / tool_result blocks sent back as the SDK builds them extend the chain."""
    rollout_id, client = start(gateway, run_id, "continuous", qwen3_vllm, qwen3_model_dir)
    claude = anthropic.Anthropic(
        base_url=str(client.base_url).replace("/openai/v1", "/anthropic"), api_key=client.api_key
    )
    messages: list[Any] = [{"role": "user", "content": "Add 2 five times."}]
    for _ in range(TURNS):
        reply = claude.messages.create(
            model="policy", system="You add.", max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS
        )
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        total = [str(sum(cast(dict[str, int], u.input).values())) for u in uses]
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": t} for u, t in zip(uses, total, strict=True)]
        messages.append({"role": "user", "content": results})
    calls = recorded(gateway, rollout_id)
    assert len(calls) == TURNS and calls[-1].api == "messages"
    assert [c.continuity for c in calls][1:] == ["extended"] * (TURNS - 1)
    assert sample_count(calls, rollout_id) == 1


def test_a_responses_api_tool_loop_is_one_sample(
    gateway: GatewayHandle,
    qwen3_vllm: TemplateVLLM,
    qwen3_model_dir: Path,
    run_id: str,
) -> None:
    """The Responses API with the whole input list sent back each turn (store=False) extends the chain."""
    rollout_id, client = start(gateway, run_id, "continuous", qwen3_vllm, qwen3_model_dir)
    items: list[Any] = [{"role": "user", "content": "Add 2 five times."}]
    for _ in range(TURNS):
        reply = client.responses.create(model="policy", instructions="You add.", input=items, tools=RESPONSES_TOOLS,
                                        store=False, max_output_tokens=64)  # fmt: skip
        items += [item.model_dump(exclude_none=True) for item in reply.output if item.type != "reasoning"]
        uses = [item for item in reply.output if item.type == "function_call"]
        if not uses:
            break
        items += [{"type": "function_call_output", "call_id": u.call_id, "output": "3"} for u in uses]
    calls = recorded(gateway, rollout_id)
    assert len(calls) == TURNS and calls[-1].api == "responses"
    assert [c.continuity for c in calls][1:] == ["extended"] * (TURNS - 1)
    assert sample_count(calls, rollout_id) == 1


def _split_token(tokenizer: Any) -> tuple[list[int], int]:
    """Two ids whose bytes together are a third token's: the canonical encoding would merge them."""
    vocab = tokenizer.get_vocab()
    for token, whole in sorted(vocab.items(), key=lambda item: item[1]):
        for cut in range(1, len(token)):
            head, tail = vocab.get(token[:cut]), vocab.get(token[cut:])
            if head is not None and tail is not None and token.isalpha():
                return [head, tail], whole
    raise AssertionError("the tokenizer has no token made of two others")


def test_byte_level_drift_stays_exact(
    gateway: GatewayHandle,
    qwen3_model_dir: Path,
    run_id: str,
) -> None:
    """A sampled pair of ids that re-encodes as one id: exact mode splits, continuous keeps the pair."""
    tokenizer = load_tokenizer(qwen3_model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pair, whole = _split_token(tokenizer)
    app = TemplateVLLM(qwen3_model_dir, lambda turn: [*pair, end] if turn == 0 else [*tokenizer.encode("ok"), end])
    counts = {}
    with Served(app) as served:
        app.url = served.url  # type: ignore[attr-defined]
        for mode in ("exact", "continuous"):
            rollout_id, client = start(gateway, f"{run_id}-{mode}", mode, app, qwen3_model_dir)
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            first = client.chat.completions.create(model="policy", messages=messages)
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "again"},
            ]
            client.chat.completions.create(model="policy", messages=messages)
            calls = recorded(gateway, rollout_id)
            counts[mode] = sample_count(calls, rollout_id)
            second_prompt = calls[1].prompt_ids
            kept = second_prompt[len(calls[0].prompt_ids) : len(calls[0].prompt_ids) + 2]
            assert (kept == pair) is (mode == "continuous"), (mode, kept, pair, whole)
    assert counts == {"exact": 2, "continuous": 1}


@pytest.mark.timeout(1200)  # the first test to use the session's vLLM server waits for it to start
def test_real_vllm_serves_a_continuous_rollout_as_one_sample(
    gateway: GatewayHandle, vllm_server: VllmServer, run_id: str
) -> None:
    """Real sampling: the first prompt is vLLM's own rendering; every later one extends the sampled ids."""
    r = gateway.admin.post("/api/runs", json={"run_id": run_id, "prompt_mode": "continuous"})
    assert r.status_code in (200, 201), r.text
    served = {"served_model": vllm_server.served_name, "tokenizer": str(vllm_server.model_dir)}
    gateway.register_model(run_id, f"{vllm_server.url}/v1", name="policy", api_key=vllm_server.api_key, **served)
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    client = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count."}]
    for turn in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=12, seed=turn)
        messages += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"more {turn}"},
        ]
    calls = recorded(gateway, rollout["rollout_id"])
    body = {"model": vllm_server.served_name, "messages": messages[:2], "max_tokens": 1, "return_token_ids": True}
    direct = vllm_server.post("/v1/chat/completions", body).json()
    assert calls[0].prompt_ids == direct["prompt_token_ids"]
    assert [c.continuity for c in calls][1:] == ["extended"] * 3
    assert all(len(c.logprobs) == len(c.response_ids) > 0 for c in calls)
    assert sample_count(calls, rollout["rollout_id"]) == 1


def test_a_model_without_a_tokenizer_is_refused_in_the_callers_shape(
    gateway: GatewayHandle, fake_vllm: Any, run_id: str
) -> None:
    """An engine with no tokenizer route and no registered directory: a 502 naming the fix, nothing recorded."""
    r = gateway.admin.post("/api/runs", json={"run_id": run_id, "prompt_mode": "continuous"})
    assert r.status_code == 201, r.text
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert refused.value.status_code == 502
    assert "register the model with `tokenizer`" in refused.value.message
    claude = anthropic.Anthropic(base_url=attempt["anthropic_base_url"], api_key=attempt["token"], max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as also:
        claude.messages.create(model="fake", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert also.value.status_code == 502 and "tokenizer" in str(also.value)
    assert recorded(gateway, rollout["rollout_id"]) == []
    assert fake_vllm.served == []
