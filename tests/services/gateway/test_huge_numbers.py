"""Numbers no float holds (10^400) are a 4xx where they enter, on every way in, before anything is generated.

Complements `test_gateway_hostile_inputs.py` with the entries it does not cover. Before: a custom
event's payload holding 10^400 was stored (201); on the Responses API `top_k` of 10^400 was
ignored and the call generated; on Messages `top_k` of 1e300 or "five" was silently dropped and
`max_tokens` of 10^400 generated up to the run's limit; any other field of a proxied body holding
10^400 was recorded as is. (A field the Responses API does not have, such as a finite `top_k`, is
still ignored, as the API ignores it.)
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle

HUGE = b"1" + b"0" * 400
HI: Any = [{"role": "user", "content": "hi"}]


def _raw(body: dict[str, Any]) -> bytes:
    """The body as JSON with every "HUGE" string written as the bare number 10^400."""
    return httpx.Request("POST", "http://x", json=body).content.replace(b'"HUGE"', HUGE)


@pytest.mark.parametrize(
    "body",
    [
        {"type": "custom", "name": "n", "payload": {"x": "HUGE"}},
        {"type": "custom", "name": "n", "payload": {"deep": [{"x": "HUGE"}]}},
        {"event_type": "n", "data": {"x": "HUGE"}},
        {"type": "reward", "value": "HUGE"},
    ],
)
def test_events_with_a_number_no_float_holds_are_a_422(
    gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM, body: dict[str, Any]
) -> None:
    _, attempt = gateway.running(run_id, fake_vllm.url)
    headers = {"authorization": f"Bearer {attempt['token']}", "content-type": "application/json"}
    answer = httpx.post(attempt["events_url"], content=_raw(body), headers=headers, timeout=10)
    assert answer.status_code == 422, answer.text
    assert isinstance(answer.json()["error"], str)


@pytest.mark.parametrize(
    ("api", "path", "body"),
    [
        ("openai", "responses", {"model": "fake", "input": "hi", "top_k": "HUGE"}),
        ("openai", "responses", {"model": "fake", "input": "hi", "top_p": "HUGE"}),
        ("openai", "chat/completions", {"model": "fake", "messages": HI, "top_k": 1e300}),
        ("openai", "chat/completions", {"model": "fake", "messages": HI, "presence_penalty": "HUGE"}),
        ("anthropic", "v1/messages", {"model": "fake", "max_tokens": 2, "messages": HI, "top_k": 1e300}),
        ("anthropic", "v1/messages", {"model": "fake", "max_tokens": 2, "messages": HI, "temperature": "HUGE"}),
        ("anthropic", "v1/messages", {"model": "fake", "max_tokens": "HUGE", "messages": HI}),
        ("anthropic", "v1/messages", {"model": "fake", "max_tokens": 2, "messages": HI, "top_k": "five"}),
        ("openai", "chat/completions", {"model": "fake", "messages": HI, "metadata": {"n": ["HUGE"]}}),
    ],
)
def test_sampling_numbers_out_of_range_are_refused_before_generation_on_every_front_end(
    gateway: GatewayHandle, run_id: str, fake_vllm: FakeVLLM, api: str, path: str, body: dict[str, Any]
) -> None:
    _, attempt = gateway.running(run_id, fake_vllm.url)
    base = attempt["proxy_base_url"] if api == "openai" else attempt["anthropic_base_url"]
    headers = {"authorization": f"Bearer {attempt['token']}", "content-type": "application/json"}
    served = len(fake_vllm.requests)
    answer = httpx.post(f"{base}/{path}", content=_raw(body), headers=headers, timeout=10)
    assert 400 <= answer.status_code < 500, answer.text
    error = answer.json()["error"]
    assert isinstance(error, dict) and error["message"], answer.text  # the front end's own error shape
    assert len(fake_vllm.requests) == served, "a refused call reached the engine"
