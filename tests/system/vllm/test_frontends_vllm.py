"""The three front ends against real vLLM: what a call records is what vLLM returned, in both prompt modes.

For Chat Completions, Responses and Messages, streamed or not, in exact and in continuous prompt
mode, a harness-style conversation (tools declared, an earlier tool call and its result, then a
second turn on the first answer) goes through the proxy to the session's vLLM server. Each
recorded call is then put to vLLM directly, and must match:

- exact mode: the recorded chat-form request, sent to `/v1/chat/completions`: the same prompt ids,
  sampled ids and logprobs;
- continuous mode: the recorded prompt ids, sent token-in to `/v1/completions`: the same sampled
  ids and logprobs; a call rendered fresh has vLLM's chat rendering of the request as its prompt
  (tools and the tool-call turn included), a second turn extends the first call's ids.

Greedy decoding, because the Responses and Messages APIs carry no seed (the chat test of
`test_processed_logprobs` covers a seeded T = 0.7 call).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gw_harness import GatewayHandle
from vllm_rig import SERVED, recorded, start_run
from vllm_server import VllmServer

from schemas import ModelRequestRecorded

SCHEMA: Any = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ARGS = '{"a": 1, "b": 2}'
MAX_TOKENS = 8


def _chat(turn: list[Any], stream: bool) -> tuple[str, dict[str, Any]]:
    messages = [
        {"role": "system", "content": "You add with the add tool."},
        {"role": "user", "content": "Add one and two."},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "three"},
    ]  # fmt: skip
    return "/chat/completions", {
        "model": SERVED, "messages": messages + [{"role": r, "content": t} for r, t in turn], "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "logprobs": True, "stream": stream,
        "tools": [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": SCHEMA}}],
    }  # fmt: skip


def _responses(turn: list[Any], stream: bool) -> tuple[str, dict[str, Any]]:
    items = [
        {"role": "user", "content": "Add one and two."},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "c1", "output": "three"},
    ]
    return "/responses", {
        "model": SERVED, "instructions": "You add with the add tool.", "max_output_tokens": MAX_TOKENS,
        "input": items + [{"role": r, "content": t} for r, t in turn], "temperature": 0.0, "stream": stream,
        "tools": [{"type": "function", "name": "add", "description": "a + b", "parameters": SCHEMA}],
    }  # fmt: skip


def _messages(turn: list[Any], stream: bool) -> tuple[str, dict[str, Any]]:
    messages = [
        {"role": "user", "content": "Add one and two."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "three"}]},
    ]
    return "/v1/messages", {
        "model": SERVED, "system": "You add with the add tool.", "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "messages": messages + [{"role": r, "content": t} for r, t in turn], "stream": stream,
        "tools": [{"name": "add", "description": "a + b", "input_schema": SCHEMA}],
    }  # fmt: skip


BUILDERS = {"chat": _chat, "responses": _responses, "messages": _messages}


def _call(attempt: dict[str, Any], api: str, turn: list[Any], stream: bool) -> None:
    path, body = BUILDERS[api](turn, stream)
    base = attempt["anthropic_base_url"] if api == "messages" else attempt["proxy_base_url"]
    headers = {"authorization": f"Bearer {attempt['token']}", "x-api-key": attempt["token"]}
    with httpx.stream("POST", f"{base}{path}", json=body, headers=headers, timeout=120) as answer:
        text = answer.read().decode()
        assert answer.status_code == 200, text
    if stream:
        assert "data:" in text, "a stream of server-sent events"


def _direct(server: VllmServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = server.post(f"/v1{path}", body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _check_exact(server: VllmServer, event: ModelRequestRecorded) -> None:
    request = {k: v for k, v in event.request.items() if k not in ("stream", "stream_options")}
    body = request | {"model": SERVED, "return_token_ids": True, "logprobs": True, "stream": False}
    direct = _direct(server, "/chat/completions", body)
    choice = direct["choices"][0]
    assert direct["prompt_token_ids"] == event.prompt_ids
    assert choice["token_ids"] == event.response_ids
    assert event.logprobs == pytest.approx([c["logprob"] for c in choice["logprobs"]["content"]], abs=1e-4)


def _check_continuous(server: VllmServer, event: ModelRequestRecorded, earlier: ModelRequestRecorded | None) -> None:
    if earlier is None:  # rendered by the gateway: vLLM's own rendering of the request
        assert event.continuity == "fresh: first call of the attempt"
        request = {k: v for k, v in event.request.items() if k not in ("stream", "stream_options")}
        rendered = _direct(
            server,
            "/chat/completions",
            request | {"model": SERVED, "max_tokens": 1, "return_token_ids": True, "stream": False},
        )
        assert rendered["prompt_token_ids"] == event.prompt_ids
    else:  # the earlier call's prompt and sampled ids, verbatim
        assert event.continuity == "extended"
        assert event.prompt_ids[: len(earlier.prompt_ids) + len(earlier.response_ids)] == (
            earlier.prompt_ids + earlier.response_ids
        )
    body = {"model": SERVED, "prompt": event.prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "logprobs": 0, "return_token_ids": True}  # fmt: skip
    choice = _direct(server, "/completions", body)["choices"][0]
    assert choice["token_ids"] == event.response_ids
    assert event.logprobs == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["exact", "continuous"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_recorded_ids_and_logprobs_are_vllms(
    gateway: GatewayHandle, vllm_server: VllmServer, run_id: str, api: str, mode: str, stream: bool
) -> None:
    extra = {"tokenizer": str(vllm_server.model_dir)} if mode == "continuous" else {}
    attempt = start_run(gateway, run_id, vllm_server, mode=mode, **extra)
    _call(attempt, api, [], stream)
    (first,) = recorded(gateway, attempt["rollout_id"])
    assert first.status == "ok" and first.api == api and len(first.response_ids) == len(first.logprobs) > 0
    answer = first.response["message"].get("content") or ""
    _call(attempt, api, [("assistant", answer), ("user", "Thanks. Now add two and two.")], stream)
    first, second = recorded(gateway, attempt["rollout_id"])
    for event, earlier in ((first, None), (second, first)):
        if mode == "exact":
            _check_exact(vllm_server, event)
        else:
            _check_continuous(vllm_server, event, earlier)
