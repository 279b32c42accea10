"""The proxy in front of the embedded CPU engine: what was recorded is exactly what the engine sampled.

Each proxied call is repeated directly against the engine with the same seed, asking for token ids
and logprobs, and the recorded event must match it token by token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gw_harness import GatewayHandle

pytest.importorskip("torch", reason="the embedded engine needs torch (pip install -e .[train])")
pytest.importorskip("transformers", reason="the embedded engine needs transformers (pip install -e .[train])")

from services.engine.background import BackgroundServer
from services.engine.server import create_app
from services.engine.tiny_model import build_tiny_model

SERVED = "tiny-gw"
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


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An embedded engine over the tiny model."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("gw-tiny"), seed=0)
    with BackgroundServer(create_app(Path(model_dir), served_name=SERVED, seed=4321, max_model_len=1024)) as server:
        yield server.url


def _direct(engine_url: str, request: dict[str, Any]) -> dict[str, Any]:
    body = {**request, "model": SERVED, "return_token_ids": True, "logprobs": True, "stream": False}
    body.pop("stream_options", None)
    response = httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _recorded(gateway: GatewayHandle, rollout_id: str) -> list[dict[str, Any]]:
    return gateway.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": "model_request"}).json()  # type: ignore[no-any-return]


def _same_as_engine(call: dict[str, Any], direct: dict[str, Any]) -> None:
    choice = next(c for c in direct["choices"] if c["index"] == call["choice_index"])
    assert call["status"] == "ok"
    assert call["prompt_ids"] == direct["prompt_token_ids"]
    assert call["response_ids"] == choice["token_ids"]
    assert call["logprobs"] == pytest.approx([t["logprob"] for t in choice["logprobs"]["content"]], abs=1e-5)
    assert call["finish_reason"] == choice["finish_reason"]
    assert call["model"] == SERVED and isinstance(call["weights_version"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_sync_calls_match_the_engine(gateway: GatewayHandle, engine_url: str, run_id: str, stream: bool) -> None:
    rollout, attempt = gateway.running(run_id, engine_url, served_model=SERVED)
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
    assert len(calls) == 1 + 2 + 1
    grouped: list[list[dict[str, Any]]] = []
    for call in calls:
        if grouped and grouped[-1][0]["call_id"] == call["call_id"]:
            grouped[-1].append(call)
        else:
            grouped.append([call])
    for request, group, text in zip(requests, grouped, texts, strict=True):
        direct = _direct(engine_url, request)
        for call in group:
            _same_as_engine(call, direct)
            message = call["response"]["message"]
            if not message.get("tool_calls"):
                assert (message["content"] or "") == text[call["choice_index"]]


async def test_async_stream_matches_the_engine(gateway: GatewayHandle, engine_url: str, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, engine_url, served_model=SERVED)
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
        _same_as_engine(by_seed[seed], _direct(engine_url, {"messages": HELLO, "max_tokens": 10, "seed": seed}))
    await client.close()
