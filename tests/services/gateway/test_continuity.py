"""Continuous prompt mode: prompts built from the sampled tokens, so a linear rollout is one sample.

Through the real gateway and the official `openai` client, against a fake vLLM that renders chat
requests with a Qwen3-style template (it drops earlier turns' reasoning and re-serialises tool-call
JSON) and answers token-in completions from the ids it is given (`template_vllm.py`). The same
scripted 6-turn tool loop runs in a run of each prompt mode; the trainer's exact merge then counts
samples per rollout.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import openai
import pytest
from gw_harness import GatewayHandle
from template_vllm import TemplateVLLM

pytest.importorskip("transformers", reason="the tiny model's tokenizer needs transformers (pip install -e .[train])")

from continuity_rig import TOOLS, TURNS, recorded, sample_count, start, tool_loop

from services.common.eventstore import EventStore
from services.tools.replay import replay_run
from trainer.core import build_step, collect_rollouts


def test_a_six_turn_tool_loop_is_one_sample_in_continuous_mode_and_splits_in_exact(
    gateway: GatewayHandle, qwen3_vllm: TemplateVLLM, qwen3_model_dir: Path, run_id: str
) -> None:
    """Exact mode re-renders (reasoning dropped, JSON re-serialised) and splits; continuous keeps the sampled ids."""
    counts = {}
    for mode in ("exact", "continuous"):
        rollout_id, client = start(gateway, f"{run_id}-{mode}", mode, qwen3_vllm, qwen3_model_dir)
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
    gateway: GatewayHandle, qwen3_vllm: TemplateVLLM, qwen3_model_dir: Path, run_id: str
) -> None:
    """Streamed calls are converted chunk by chunk: the harness rebuilds the same tool calls and text."""
    rollout_id, client = start(gateway, run_id, "continuous", qwen3_vllm, qwen3_model_dir)
    messages = tool_loop(client, stream=True)
    assert messages[-1]["content"] == "\n\nThe sum is 12."
    calls = recorded(gateway, rollout_id)
    assert [c.continuity for c in calls][1:] == ["extended"] * (TURNS - 1)
    assert sample_count(calls, rollout_id) == 1


def test_a_compacting_harness_starts_a_second_chain_and_says_why(
    gateway: GatewayHandle, qwen3_vllm: TemplateVLLM, qwen3_model_dir: Path, run_id: str
) -> None:
    """Dropping old turns at turn 4: that call is rendered fresh, with the reason; the rest extend it."""
    rollout_id, client = start(gateway, run_id, "continuous", qwen3_vllm, qwen3_model_dir)
    tool_loop(client, compact_at=4)
    calls = recorded(gateway, rollout_id)
    kinds = [c.continuity for c in calls]
    assert kinds[:4] == ["fresh: first call of the attempt", "extended", "extended", "extended"]
    assert kinds[4] == "fresh: history differs from every earlier call at message 2"
    assert kinds[5] == "extended"
    assert sample_count(calls, rollout_id) == 2


def test_calls_alternating_between_two_gateways_extend_one_chain(
    gateway: GatewayHandle, second: GatewayHandle, qwen3_vllm: TemplateVLLM, qwen3_model_dir: Path, run_id: str
) -> None:
    """Round-robin over two replicas: each finds the other's calls on the stream, the chain holds."""
    rollout_id, client = start(gateway, run_id, "continuous", qwen3_vllm, qwen3_model_dir)
    other = openai.OpenAI(
        base_url=str(client.base_url).replace(gateway.url, second.url), api_key=client.api_key, max_retries=0
    )
    tool_loop(client, other)
    calls = recorded(gateway, rollout_id)
    assert len(calls) == TURNS
    assert [c.continuity for c in calls][1:] == ["extended"] * (TURNS - 1)
    assert sample_count(calls, rollout_id) == 1


async def test_replay_of_a_continuous_run_equals_what_the_trainer_builds(
    gateway: GatewayHandle, qwen3_vllm: TemplateVLLM, qwen3_model_dir: Path, run_id: str, store: EventStore
) -> None:
    """Two groups of two rollouts recorded in continuous mode: `replay_run` rebuilds the trainer's step."""
    r = gateway.admin.post("/api/runs", json={"run_id": run_id, "prompt_mode": "continuous"})
    assert r.status_code == 201, r.text
    gateway.register_model(run_id, f"{qwen3_vllm.url}/v1", name="policy", served_model="qwen3-style",  # type: ignore[attr-defined]
                           tokenizer=str(qwen3_model_dir), reasoning_parser="qwen3")  # fmt: skip
    for index in range(4):
        rollout = gateway.create(run_id, group_id=f"g{index // 2}")[0]
        rid = rollout["rollout_id"]
        attempt = gateway.attempt(rid)
        tool_loop(openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0))
        reward = {"type": "reward", "value": float(index % 2)}
        posted = gateway.admin.post(f"/api/rollouts/{rid}/attempt/{attempt['attempt_id']}/events", json=reward)
        assert posted.status_code in (200, 201), posted.text
        for status in ("running", "succeeded"):
            done = gateway.admin.patch(
                f"/api/rollouts/{rid}", json={"status": status, "attempt_id": attempt["attempt_id"]}
            )
            assert done.status_code == 200, done.text
    events = [stored.event async for stored in store.read_run(run_id)]
    report = await replay_run(store, run_id)
    (scheme,) = report.schemes
    built = build_step(collect_rollouts(events).rollouts, scheme.config)
    assert len(built.samples) == 4 and built.stats.samples_per_rollout_mean == 1.0
    key = [(s.rollout_id, s.index, s.response_tokens, s.advantage, s.token_weight) for s in built.samples]
    assert [(s.rollout_id, s.index, s.response_tokens, s.advantage, s.token_weight) for s in scheme.samples] == key
    assert [s.prompt_tokens for s in scheme.samples] == [len(s.tokens) - s.response_tokens for s in built.samples]


def test_interleaved_sub_agents_each_extend_their_own_chain(
    gateway: GatewayHandle, qwen3_vllm: TemplateVLLM, qwen3_model_dir: Path, run_id: str
) -> None:
    """Two conversations alternating in one attempt: every call after the first of each extends its own."""
    rollout_id, client = start(gateway, run_id, "continuous", qwen3_vllm, qwen3_model_dir)
    conversations: list[list[Any]] = [
        [{"role": "system", "content": f"You are sub-agent {name}."}, {"role": "user", "content": "Add 2 twice."}]
        for name in ("A", "B")
    ]
    for _turn in range(3):
        for messages in conversations:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": "4"} for c in message.get("tool_calls") or []
            ]
    calls = recorded(gateway, rollout_id)
    assert [c.continuity for c in calls] == [
        "fresh: first call of the attempt", "fresh: a new conversation (no earlier assistant turn)", *["extended"] * 4
    ]  # fmt: skip
    assert sample_count(calls, rollout_id) == 2


def test_a_token_in_call_reserves_its_prompt_ids_exactly(
    gateway: GatewayHandle, qwen3_vllm: TemplateVLLM, qwen3_model_dir: Path, run_id: str
) -> None:
    """Against a token budget, a continuous-mode call counts its prompt as its ids (not its payload's bytes,
    several times more): a budget of the prompt and 7 tokens lowers the call's max_tokens to 7."""
    ask: Any = {"model": "policy", "messages": [{"role": "user", "content": "add 1 and 2, please"}], "max_tokens": 50}
    rollout_id, client = start(gateway, f"{run_id}-free", "continuous", qwen3_vllm, qwen3_model_dir)
    client.chat.completions.create(**ask)
    (free,) = recorded(gateway, rollout_id)
    prompt = len(free.prompt_ids)
    assert prompt > 10  # its token-in payload is hundreds of bytes

    budgeted = f"{run_id}-budget"
    spec = {"run_id": budgeted, "prompt_mode": "continuous", "budget": {"tokens": prompt + 7}}
    assert gateway.admin.post("/api/runs", json=spec).status_code in (200, 201)
    extra = {"tokenizer": str(qwen3_model_dir), "reasoning_parser": "qwen3"}
    gateway.register_model(budgeted, f"{qwen3_vllm.url}/v1", name="policy", served_model="qwen3-style", **extra)  # type: ignore[attr-defined]
    rollout = gateway.create(budgeted)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    client = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    client.chat.completions.create(**ask)
    (call,) = recorded(gateway, rollout["rollout_id"])
    assert call.status == "ok" and call.prompt_ids == free.prompt_ids
    assert call.request["max_tokens"] == 7
