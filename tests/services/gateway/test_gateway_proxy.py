"""The proxy with the official `openai` client against the fake vLLM upstream: every call recorded exactly."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "look something up",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
MESSAGES: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def _calls(gateway: GatewayHandle, rollout_id: str) -> list[dict[str, Any]]:
    events = gateway.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": "model_request"})
    assert events.status_code == 200, events.text
    return events.json()  # type: ignore[no-any-return]


def _check_against_served(calls: list[dict[str, Any]], served: list[dict[str, Any]]) -> None:
    """Each recorded choice carries exactly the prompt ids, token ids and logprobs the engine sampled."""
    assert len(calls) == len(served)
    by_choice = sorted(calls, key=lambda c: (c["call_id"], c["choice_index"]))
    for call, sample in zip(sorted(by_choice, key=lambda c: c["seq"]), served, strict=True):
        assert call["status"] == "ok"
        assert call["prompt_ids"] == sample["prompt_ids"]
        assert call["response_ids"] == sample["token_ids"]
        assert call["logprobs"] == pytest.approx(sample["logprobs"])
        assert call["finish_reason"] == sample["finish_reason"]
        assert call["choice_index"] == sample["index"]
        assert call["weights_version"] == 7


def test_sync_non_stream_and_stream(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
    answer = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=5, temperature=0.7)
    choice = answer.choices[0]
    assert choice.message.content and choice.logprobs is None
    assert "prompt_token_ids" not in (answer.model_extra or {})
    assert "token_ids" not in (choice.model_extra or {})
    assert answer.usage is not None and answer.usage.completion_tokens == 5
    pieces = []
    stream = client.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=6, stream=True)
    for chunk in stream:
        assert "token_ids" not in str(chunk.model_extra)
        assert chunk.usage is None
        for c in chunk.choices:
            assert c.logprobs is None
            pieces.append(c.delta.content or "")
    assert len("".join(pieces).split()) == 6
    calls = _calls(gateway, rollout["rollout_id"])
    _check_against_served(calls, fake_vllm.served)
    assert calls[0]["request"]["messages"] == MESSAGES and calls[0]["request"]["temperature"] == 0.7
    assert calls[0]["response"]["message"]["content"] == choice.message.content
    assert calls[1]["response"]["message"]["content"] == "".join(pieces)
    assert calls[0]["usage"]["completion_tokens"] == 5 and calls[0]["latency_s"] > 0
    assert calls[0]["mode"] == "train" and calls[0]["attempt_id"] == attempt["attempt_id"]
    # what the upstream was asked for: token ids and logprobs, on top of what the client sent
    assert all(r["return_token_ids"] and r["logprobs"] for r in fake_vllm.requests)


def test_client_requested_extras_are_kept(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
    answer = client.chat.completions.create(
        model="fake", messages=MESSAGES, max_tokens=3, logprobs=True, extra_body={"return_token_ids": True}
    )
    assert answer.choices[0].logprobs is not None and len(answer.choices[0].logprobs.content or []) == 3
    assert answer.model_extra and answer.model_extra["prompt_token_ids"] == fake_vllm.served[0]["prompt_ids"]
    chunks = list(
        client.chat.completions.create(
            model="fake", messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_tools_and_n2(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, stream: bool) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
    if stream:
        calls_by_index: dict[int, dict[str, str]] = {}
        for chunk in client.chat.completions.create(
            model="fake", messages=MESSAGES, tools=TOOLS, n=2, max_tokens=4, stream=True
        ):
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    slot = calls_by_index.setdefault(c.index, {"name": "", "arguments": ""})
                    slot["name"] += (tc.function.name or "") if tc.function else ""
                    slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        assert sorted(calls_by_index) == [0, 1] and all(v["name"] == "search" for v in calls_by_index.values())
    else:
        answer = client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS, n=2, max_tokens=4)
        assert len(answer.choices) == 2
        assert all(c.finish_reason == "tool_calls" and c.message.tool_calls for c in answer.choices)
    calls = _calls(gateway, rollout["rollout_id"])
    assert len({c["call_id"] for c in calls}) == 1 and sorted(c["choice_index"] for c in calls) == [0, 1]
    _check_against_served(sorted(calls, key=lambda c: c["choice_index"]), fake_vllm.served)
    assert calls[0]["request"]["tools"] == TOOLS
    recorded = calls[0]["response"]["message"]["tool_calls"][0]
    assert recorded["function"]["name"] == "search" and recorded["function"]["arguments"].startswith('{"x": ')


async def test_async_client_concurrent(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client: Any = openai.AsyncOpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])

    async def one(i: int) -> str:
        messages: Any = [{"role": "user", "content": f"question {i}"}]
        if i % 2:
            out: list[str] = []
            async for chunk in await client.chat.completions.create(
                model="fake", messages=messages, stream=True, max_tokens=4
            ):
                out.extend(c.delta.content or "" for c in chunk.choices)
            return "".join(out)
        answer = await client.chat.completions.create(model="fake", messages=messages, max_tokens=4)
        return answer.choices[0].message.content or ""

    texts = await asyncio.gather(*[one(i) for i in range(16)])
    assert all(len(t.split()) == 4 for t in texts)
    calls = _calls(gateway, rollout["rollout_id"])
    assert len(calls) == 16
    served = {tuple(s["prompt_ids"]): s for s in fake_vllm.served}
    for call in calls:
        sample = served[tuple(call["prompt_ids"])]
        assert call["response_ids"] == sample["token_ids"] and call["logprobs"] == pytest.approx(sample["logprobs"])
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model", "fake"]  # the endpoint's list, then the registered name
    await client.close()


def test_upstream_error_and_timeout(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    client: Any = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    fake_vllm.fail_status = 500
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model="fake", messages=MESSAGES)
    assert failed.value.status_code == 500 and "fake upstream failure" in str(failed.value)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="fake", messages=MESSAGES, stream=True)
    fake_vllm.fail_status = None
    fake_vllm.hang_s = 3.0  # the test gateway's upstream timeout is 2 s
    with pytest.raises(openai.APIStatusError) as timed_out:
        client.chat.completions.create(model="fake", messages=MESSAGES)
    assert timed_out.value.status_code == 504
    calls = _calls(gateway, rollout["rollout_id"])
    assert [c["status"] for c in calls] == ["failed", "failed", "failed"]
    assert "500" in calls[0]["error"] and "timed out" in calls[2]["error"]
    assert all(c["response_ids"] == [] for c in calls)


async def test_disconnect_mid_stream_is_recorded_as_aborted(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    fake_vllm.token_delay_s = 0.05
    headers = {"authorization": f"Bearer {attempt['token']}"}
    body = {"model": "fake", "messages": MESSAGES, "max_tokens": 200, "stream": True}
    async with httpx.AsyncClient() as client:
        async with client.stream(
            "POST", attempt["proxy_base_url"] + "/chat/completions", json=body, headers=headers
        ) as response:
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    seen += 1
                if seen >= 4:
                    break  # leaving the block closes the connection mid-stream
    for _ in range(100):
        calls = _calls(gateway, rollout["rollout_id"])
        if calls and fake_vllm.aborted:
            break
        await asyncio.sleep(0.05)
    assert fake_vllm.aborted == 1, "the upstream call was not cancelled"
    assert len(calls) == 1 and calls[0]["status"] == "aborted"
    assert 0 < len(calls[0]["response_ids"]) < 200
    assert calls[0]["response_ids"] == fake_vllm.served[0]["token_ids"][: len(calls[0]["response_ids"])]


def test_disconnect_before_a_non_streamed_answer_is_aborted(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    fake_vllm.delay_s = 1.0
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            attempt["proxy_base_url"] + "/chat/completions",
            json={"model": "m", "messages": MESSAGES},
            headers={"authorization": f"Bearer {attempt['token']}"},
            timeout=0.3,
        )
    for _ in range(100):
        calls = _calls(gateway, rollout["rollout_id"])
        if calls:
            break
        time.sleep(0.05)
    assert [c["status"] for c in calls] == ["aborted"] and calls[0]["response_ids"] == []


def test_malformed_proxy_requests_are_4xx(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _, attempt = gateway.running(run_id, fake_vllm.url)
    headers = {"authorization": f"Bearer {attempt['token']}"}
    chat = attempt["proxy_base_url"] + "/chat/completions"
    assert httpx.post(chat, content=b"[1, 2]", headers=headers).status_code == 422
    assert httpx.post(chat, content=b"{nope", headers=headers).status_code == 422
    missing = httpx.post(chat, json={"model": "m"}, headers=headers)
    assert missing.status_code == 422 and missing.json()["error"]["field"] == "messages"
    assert httpx.post(chat, content=b"{" + b" " * 1_100_000 + b"}", headers=headers).status_code == 413
    admin = {"authorization": f"Bearer {gateway.settings.admin_token}"}
    bad_id = httpx.post(
        f"{gateway.url}/proxy/rollout/a.b/attempt/x/mode/train/openai/v1/chat/completions",
        json={"messages": []},
        headers=admin,
    )
    assert bad_id.status_code == 422 and bad_id.json()["error"]["field"] == "rollout_id"
    assert httpx.get(attempt["proxy_base_url"] + "/embeddings", headers=headers).status_code == 404
    assert fake_vllm.started == 0
