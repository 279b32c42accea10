"""The proxy in front of real vLLM: what was recorded is exactly what vLLM sampled.

Each proxied call is repeated directly against vLLM (the session's server, `tests/vllm_server.py`)
with the same seed, asking for token ids and logprobs, and the recorded event must match it token
by token. The proxy reaches vLLM with the key registered with the model; the agent never has it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from gw_harness import GatewayHandle
from vllm_server import VllmServer

# The first test to use the session's vLLM server waits for it to start: minutes on 2 loaded cores.
pytestmark = pytest.mark.timeout(1200)

SERVED = "tiny"
HELLO: Any = [{"role": "user", "content": "Say something short."}]
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "find a fact",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def _running(gateway: GatewayHandle, run_id: str, server: VllmServer) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rollout with a started attempt whose model is vLLM, registered with its key."""
    gateway.register_model(run_id, f"{server.url}/v1", served_model=SERVED, api_key=server.api_key)
    rollout = gateway.create(run_id)[0]
    return rollout, gateway.attempt(rollout["rollout_id"])


def _direct(engine_url: str, request: dict[str, Any], key: str) -> dict[str, Any]:
    body = {**request, "model": SERVED, "return_token_ids": True, "logprobs": True, "stream": False}
    body.pop("stream_options", None)
    headers = {"authorization": f"Bearer {key}"}
    response = httpx.post(f"{engine_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _recorded(gateway: GatewayHandle, rollout_id: str) -> list[dict[str, Any]]:
    return gateway.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": "model_request"}).json()  # type: ignore[no-any-return]


def _same_as_engine(call: dict[str, Any], direct: dict[str, Any]) -> None:
    choice = next(c for c in direct["choices"] if c["index"] == call["choice_index"])
    assert call["status"] == "ok"
    assert call["prompt_ids"] == direct["prompt_token_ids"]
    assert call["response_ids"] == choice["token_ids"]
    assert call["logprobs"] == pytest.approx([t["logprob"] for t in choice["logprobs"]["content"]], abs=1e-4)
    assert call["finish_reason"] == choice["finish_reason"]
    assert call["model"] == SERVED


@pytest.mark.parametrize("stream", [False, True])
def test_sync_calls_match_the_engine(
    gateway: GatewayHandle, vllm_server: VllmServer, run_id: str, stream: bool
) -> None:
    engine_url = vllm_server.url
    rollout, attempt = _running(gateway, run_id, vllm_server)
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
    requests = [
        {"messages": HELLO, "max_tokens": 12, "seed": 3, "temperature": 1.0},
        {"messages": HELLO, "max_tokens": 8, "seed": 5, "n": 2},
        {"messages": HELLO, "max_tokens": 16, "seed": 7, "tools": TOOLS},
    ]
    texts = []
    for request in requests:
        if stream:
            pieces: dict[int, str] = {}
            for chunk in client.chat.completions.create(model="anything", stream=True, **request):
                assert "token_ids" not in str(chunk.model_extra)
                for c in chunk.choices:
                    pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
            texts.append(pieces)
        else:
            answer = client.chat.completions.create(model="anything", **request)
            assert answer.choices[0].logprobs is None and "prompt_token_ids" not in (answer.model_extra or {})
            texts.append({c.index: c.message.content or "" for c in answer.choices})
    calls = sorted(_recorded(gateway, rollout["rollout_id"]), key=lambda c: c["seq"])
    assert len(calls) == 1 + 2 + 1, [(c["call_id"], c["choice_index"], c["status"], c.get("error")) for c in calls]
    grouped: list[list[dict[str, Any]]] = []
    for call in calls:
        if grouped and grouped[-1][0]["call_id"] == call["call_id"]:
            grouped[-1].append(call)
        else:
            grouped.append([call])
    for request, group, text in zip(requests, grouped, texts, strict=True):
        direct = _direct(engine_url, request, vllm_server.api_key)
        for call in group:
            _same_as_engine(call, direct)
            message = call["response"]["message"]
            if not message.get("tool_calls"):
                assert (message["content"] or "") == text[call["choice_index"]]


async def test_async_stream_matches_the_engine(gateway: GatewayHandle, vllm_server: VllmServer, run_id: str) -> None:
    engine_url = vllm_server.url
    rollout, attempt = _running(gateway, run_id, vllm_server)
    client = openai.AsyncOpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])

    async def one(seed: int) -> None:
        stream = await client.chat.completions.create(
            model=SERVED, messages=HELLO, max_tokens=10, seed=seed, stream=True
        )
        async for _ in stream:
            pass

    await asyncio.gather(*[one(seed) for seed in range(4)])
    calls = _recorded(gateway, rollout["rollout_id"])
    assert len(calls) == 4
    by_seed = {call["request"]["seed"]: call for call in calls}
    for seed in range(4):
        direct = _direct(engine_url, {"messages": HELLO, "max_tokens": 10, "seed": seed}, vllm_server.api_key)
        _same_as_engine(by_seed[seed], direct)
    await client.close()


def test_vllms_own_answer_is_read_on_the_int32_path_and_passed_back_whole(
    gateway: GatewayHandle, vllm_server: VllmServer, run_id: str
) -> None:
    """vLLM's JSON for `prompt_token_ids` is what the proxy parses straight into int32 (not the list
    fallback), and a client that asks for the ids gets vLLM's own back through the proxy."""
    import numpy as np

    from services.gateway.proxy.openai_format import decode_completion
    from services.gateway.proxy.promptids import prompt_token_ids

    request = {"messages": HELLO, "max_tokens": 4, "seed": 11, "temperature": 1.0}
    body = {**request, "model": SERVED, "return_token_ids": True, "logprobs": True}
    headers = {"authorization": f"Bearer {vllm_server.api_key}"}
    raw = httpx.post(f"{vllm_server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert raw.status_code == 200, raw.text
    ids = prompt_token_ids(decode_completion(raw.content)["prompt_token_ids"])
    assert isinstance(ids, np.ndarray) and ids.tolist() == raw.json()["prompt_token_ids"]

    rollout, attempt = _running(gateway, run_id, vllm_server)
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
    answer = client.chat.completions.create(model="anything", extra_body={"return_token_ids": True}, **request)
    assert answer.model_extra["prompt_token_ids"] == ids.tolist()
    (call,) = _recorded(gateway, rollout["rollout_id"])
    assert call["prompt_ids"] == ids.tolist() and call["status"] == "ok"


def test_vllms_token_in_answer_is_read_without_decoding_its_ids(
    vllm_server: VllmServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's `/v1/completions` answer to a token-id prompt (continuous mode's request) is compact: its
    choice's `prompt_token_ids` are cut out before the answer is decoded, and parse to vLLM's own ids."""
    import numpy as np

    from services.gateway.proxy import tokenin
    from services.gateway.proxy.promptids import cut_prompt_ids, prompt_token_ids

    decoded: list[bytes] = []
    decode = tokenin._decode_completion
    monkeypatch.setattr(tokenin, "_decode_completion", lambda content: decoded.append(content) or decode(content))

    prompt = list(range(100, 1300))
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 4, "return_token_ids": True, "logprobs": 0}
    headers = {"authorization": f"Bearer {vllm_server.api_key}"}
    raw = httpx.post(f"{vllm_server.url}/v1/completions", json=body, headers=headers, timeout=120)
    assert raw.status_code == 200, raw.text
    (sent,) = raw.json()["choices"]
    cut = cut_prompt_ids(raw.content)
    assert cut is not None and len(cut[0]) < len(raw.content) // 2  # the ids are most of the answer
    (choice,) = tokenin.decode_completion(raw.content)["choices"]
    assert decoded == [cut[0]]  # decoded once, without the ids
    ids = prompt_token_ids(choice["prompt_token_ids"])
    assert isinstance(ids, np.ndarray) and ids.tolist() == sent["prompt_token_ids"] == prompt
    assert choice["token_ids"] == sent["token_ids"] and choice["text"] == sent["text"]
