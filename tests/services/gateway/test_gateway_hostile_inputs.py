"""Inputs an agent controls that once made the gateway answer 500: each is now a clear 4xx in the caller's
API shape, and a call refused this way is refused before anything is generated.

Once 500s: `"tools": 1.5` on Messages, Responses and `count_tokens`; JSON nested 2,000 levels deep;
a reward of 10^400; `top_k` of 10^400 (which failed after generation, unrecorded and unbudgeted).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle

DEEP = b'{"a": ' + b"[" * 2000 + b"]" * 2000 + b"}"
HI: Any = [{"role": "user", "content": "hi"}]
HUGE = "1" + "0" * 400
"""10^400 written out as a JSON integer (no float holds it)."""


def _shape(api: str, answer: httpx.Response) -> str:
    """The error message, checked to be in the API's own error shape."""
    body = answer.json()
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"], body
        return body["error"]["message"]  # type: ignore[no-any-return]
    if api == "openai":
        assert isinstance(body["error"], dict) and body["error"]["type"], body
        return body["error"]["message"]  # type: ignore[no-any-return]
    assert isinstance(body["error"], str), body
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("api", "path", "body"),
    [
        ("anthropic", "v1/messages", {"model": "m", "max_tokens": 2, "messages": HI, "tools": 1.5}),
        ("anthropic", "v1/messages/count_tokens", {"model": "m", "messages": HI, "tools": 1.5}),
        ("openai", "responses", {"model": "m", "input": "hi", "tools": 1.5}),
        ("openai", "chat/completions", {"model": "m", "messages": HI, "tools": 1.5}),
        ("anthropic", "v1/messages", {"model": "m", "max_tokens": 2, "messages": HI, "tools": [1.5]}),
        ("openai", "responses", {"model": "m", "input": "hi", "tools": [1.5]}),
    ],
)
def test_tools_of_the_wrong_type_are_a_4xx(
    gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM, api: str, path: str, body: dict[str, Any]
) -> None:
    _, attempt = gateway.running(run_id, fake_vllm.url)
    base = attempt["proxy_base_url"] if api == "openai" else attempt["anthropic_base_url"]
    served = len(fake_vllm.requests)
    answer = httpx.post(f"{base}/{path}", json=body, headers=_agent(attempt), timeout=10)
    assert 400 <= answer.status_code < 500, answer.text
    assert "tools" in _shape(api, answer)
    assert len(fake_vllm.requests) == served, "a refused call reached the engine"


def test_json_nested_2000_deep_is_a_4xx_everywhere(gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM) -> None:
    _, attempt = gateway.running(run_id, fake_vllm.url)
    targets = [
        ("openai", f"{attempt['proxy_base_url']}/chat/completions"),
        ("openai", f"{attempt['proxy_base_url']}/responses"),
        ("anthropic", f"{attempt['anthropic_base_url']}/v1/messages"),
        ("anthropic", f"{attempt['anthropic_base_url']}/v1/messages/count_tokens"),
        ("api", attempt["events_url"]),
        ("api", f"{gateway.url}/api/rollouts"),
        ("api", f"{gateway.url}/api/runs"),
    ]
    for api, url in targets:
        headers = {**_agent(attempt), "content-type": "application/json"}
        if api == "api" and "/events" not in url:
            headers["authorization"] = gateway.admin.headers["authorization"]
        answer = httpx.post(url, content=DEEP, headers=headers, timeout=10)
        assert answer.status_code == 422, (url, answer.status_code, answer.text)
        assert "nested" in _shape(api, answer), url


@pytest.mark.parametrize(
    "body",
    [
        b'{"type": "reward", "value": ' + HUGE.encode() + b"}",
        b'{"type": "reward", "value": 1e400}',
        b'{"event_type": "reward", "data": {"value": ' + HUGE.encode() + b"}}",
        b'{"event_type": "reward", "data": {"value": 1e400}}',
    ],
)
def test_numbers_no_float_holds_are_a_422(
    gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM, body: bytes
) -> None:
    _, attempt = gateway.running(run_id, fake_vllm.url)
    headers = {**_agent(attempt), "content-type": "application/json"}
    answer = httpx.post(attempt["events_url"], content=body, headers=headers, timeout=10)
    assert answer.status_code == 422, answer.text
    _shape("api", answer)


@pytest.mark.parametrize(
    ("api", "path", "body", "param"),
    [
        ("openai", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": HUGE}, "top_k"),
        ("openai", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 1.5}, "top_k"),
        ("openai", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": HUGE}, "seed"),
        ("openai", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": HUGE},
         "temperature"),
        ("openai", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": "x"}, "top_p"),
        ("anthropic", "v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                                      "top_k": HUGE}, "top_k"),
        ("openai", "responses", {"input": "hi", "temperature": HUGE}, "temperature"),
    ],
)  # fmt: skip
def test_sampling_parameters_out_of_range_are_refused_before_generation(
    gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM, api: str, path: str, body: dict[str, Any], param: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    base = attempt["proxy_base_url"] if api == "openai" else attempt["anthropic_base_url"]
    raw = httpx.Request("POST", "http://x", json=body).content.replace(f'"{HUGE}"'.encode(), HUGE.encode())
    served = len(fake_vllm.requests)
    headers = {**_agent(attempt), "content-type": "application/json"}
    answer = httpx.post(f"{base}/{path}", content=raw, headers=headers, timeout=10)
    assert 400 <= answer.status_code < 500, answer.text
    assert param in _shape(api, answer)
    assert len(fake_vllm.requests) == served, "a refused call reached the engine"
    fine = httpx.post(f"{attempt['proxy_base_url']}/chat/completions", headers=_agent(attempt), timeout=10,
                      json={"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "max_tokens": 2})  # fmt: skip
    assert fine.status_code == 200, fine.text  # the attempt is unharmed: nothing was recorded in its name
    assert rollout["rollout_id"]


def _agent(attempt: dict[str, Any]) -> dict[str, str]:
    return {"authorization": f"Bearer {attempt['token']}"}
