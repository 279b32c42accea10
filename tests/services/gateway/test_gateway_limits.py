"""Per-call limits and per-attempt budgets, through the official `openai` client.

Regression for the issue's `n=1000` call (1,000 events, 51 MB, for a 0.1 MB answer): `n`,
`max_tokens`, tools and messages are bounded by the run's spec, refused before anything is
forwarded or recorded, in OpenAI's error shape. A budget-spent attempt is refused with a 403 and
the refusal recorded as a `budget_exceeded` event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle

from services.common.bytecache import ByteLRU
from services.gateway.idempotency import IdempotencyCache

MESSAGES: Any = [{"role": "user", "content": "hello"}]


def _run(gateway: GatewayHandle, run_id: str, **spec: Any) -> None:
    r = gateway.admin.post("/api/runs", json={"run_id": run_id, "command": ["true"], **spec})
    assert r.status_code == 201, r.text


def _client(attempt: dict[str, Any]) -> Any:
    return openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)


def _events(gateway: GatewayHandle, rollout_id: str, kind: str) -> list[dict[str, Any]]:
    r = gateway.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": kind})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_n_and_sizes_bounded_by_the_run(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _run(gateway, run_id, limits={"max_n": 4, "max_tokens": 64, "max_tools": 1, "max_messages": 3})
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client = _client(attempt)
    tool: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused: list[tuple[dict[str, Any], str]] = [
        ({"n": 1000}, "n"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tools": [tool, tool]}, "tools"),
        ({"messages": MESSAGES * 4}, "messages"),
    ]
    for extra, param in refused:
        body = {"model": "fake", "messages": MESSAGES, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**body)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param, error
        assert error["type"] == "invalid_request_error" and error["message"]
    assert fake_vllm.served == []  # nothing was forwarded
    answer = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=4, n=4)
    assert len(answer.choices) == 4
    assert len(_events(gateway, rollout["rollout_id"], "model_request")) == 4
    # a harness's own fixed ceiling (Claude Code sends 64,000) is lowered to the run's limit, not refused
    client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=100_000)
    assert fake_vllm.requests[-1]["max_tokens"] == 64
    events = _events(gateway, rollout["rollout_id"], "model_request")
    assert events[-1]["request"]["max_tokens"] == 64


def test_defaults_bound_a_run_without_spec(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _, attempt = gateway.running(run_id, fake_vllm.url)
    with pytest.raises(openai.BadRequestError):
        _client(attempt).chat.completions.create(model="fake", messages=MESSAGES, max_tokens=4, n=1_730_219)


def test_call_and_token_budgets(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _run(gateway, run_id, budget={"calls": 3})
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client = _client(attempt)
    for _ in range(3):
        client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=4)
    for _ in range(2):
        with pytest.raises(openai.PermissionDeniedError) as caught:
            client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=4)
        assert caught.value.body["code"] == "budget_exceeded" and caught.value.body["param"] == "calls"  # type: ignore[index]
    assert len(_events(gateway, rollout["rollout_id"], "model_request")) == 3
    recorded = [e for e in _events(gateway, rollout["rollout_id"], "custom") if e["name"] == "budget_exceeded"]
    assert len(recorded) == 1 and recorded[0]["payload"]["budget"] == "calls"

    tokens_run = f"{run_id}-tok"
    _run(gateway, tokens_run, budget={"tokens": 300})
    _, attempt = gateway.running(tokens_run, fake_vllm.url)
    client = _client(attempt)
    # The call reserves its request's size (a bound on its prompt) + max_tokens: more than is left, so its
    # max_tokens is lowered to what is; the next call finds no room for its prompt.
    first = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=200)
    assert 0 < first.usage.completion_tokens < 200 and first.usage.total_tokens <= 300
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=8)
    assert caught.value.body["param"] == "tokens"  # type: ignore[index]


async def test_concurrent_calls_cannot_pass_the_call_budget(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    _run(gateway, run_id, budget={"calls": 5})
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client = openai.AsyncOpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)

    async def one() -> bool:
        try:
            await client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=4)
            return True
        except openai.PermissionDeniedError:
            return False

    results = await asyncio.gather(*(one() for _ in range(20)))
    assert sum(results) == 5
    assert len(_events(gateway, rollout["rollout_id"], "model_request")) == 5


def test_wall_time_budget(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _run(gateway, run_id, budget={"wall_s": 0.5})
    _, attempt = gateway.running(run_id, fake_vllm.url)
    client = _client(attempt)
    client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=4)
    time.sleep(0.7)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=4)
    assert caught.value.body["param"] == "wall_s"  # type: ignore[index]


def test_byte_bounded_cache_evicts_by_size() -> None:
    cache: ByteLRU[str, bytes] = ByteLRU(10_000, len)
    for i in range(100):
        cache.put(str(i), b"x" * 1000)
    assert cache.bytes <= 10_000 and len(cache) < 10 and cache.get("99") is not None and cache.get("0") is None
    cache.put("huge", b"x" * 20_000)
    assert cache.get("huge") is None


async def test_idempotency_cache_is_bounded_by_bytes() -> None:
    cache = IdempotencyCache(max_bytes=1_000_000)

    async def big() -> tuple[int, bytes]:
        return 201, b"x" * 100_000

    for i in range(200):  # the 200 custom events of 1 MB each, scaled down
        await cache.run(("s", "POST", "/p", str(i)), "f", big)
    assert cache.bytes <= 1_000_000
