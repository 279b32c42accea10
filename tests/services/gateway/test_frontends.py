"""The Responses API and Anthropic's Messages API on the proxy, with the official SDKs, unmodified.

Each client is configured only by base URL, key and model. Every call must be recorded with the
exact token ids the engine sampled, and a tool round trip over either API must merge into the
same training samples as the same conversation over Chat Completions.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from test_gateway_proxy import _calls, _check_against_served

from services.common.eventstore import EventStore
from trainer.core import plain
from trainer.core.calls import rollout_calls
from trainer.core.config import AdapterConfig
from trainer.core.step import merge_rollout

SCHEMA: Any = {"type": "object", "properties": {"x": {"type": "integer"}}}
CHAT_TOOLS: Any = [{"type": "function", "function": {"name": "search", "description": "look up", "parameters": SCHEMA}}]
RESPONSES_TOOLS: Any = [{"type": "function", "name": "search", "description": "look up", "parameters": SCHEMA}]
ANTHROPIC_TOOLS: Any = [{"name": "search", "description": "look up", "input_schema": SCHEMA}]
SYSTEM, QUESTION, RESULT = "be brief", "what is x?", "x is 42"


def _clients(attempt: dict[str, Any]) -> tuple[Any, Any]:
    oai = openai.OpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"])
    claude = anthropic.Anthropic(base_url=attempt["anthropic_base_url"], api_key=attempt["token"])
    return oai, claude


async def _samples(gateway: GatewayHandle, store: EventStore, run_id: str, rollout_id: str) -> list[Any]:
    """The rollout, ended as succeeded, merged by the trainer's adapter."""
    for status in ("running", "succeeded"):
        r = gateway.admin.patch(f"/api/rollouts/{rollout_id}", json={"status": status})
        assert r.status_code == 200, r.text
    events = [stored.event for stored in await store.read_rollout(run_id, rollout_id)]
    merged = merge_rollout(rollout_calls(events), AdapterConfig(), 1.0)
    return [plain((s.tokens, s.loss_mask, s.logprobs, s.response_tokens)) for s in merged.samples]


def _chat_round_trip(attempt: dict[str, Any]) -> None:
    oai, _ = _clients(attempt)
    messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = oai.chat.completions.create(model="fake", messages=messages, tools=CHAT_TOOLS, max_tokens=4)
    call = first.choices[0].message.tool_calls[0]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    oai.chat.completions.create(model="fake", messages=messages, tools=CHAT_TOOLS, max_tokens=4)


def test_responses_plain_and_streaming(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    oai, _ = _clients(attempt)
    plain = oai.responses.create(model="fake", instructions=SYSTEM, input=QUESTION, max_output_tokens=5)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert len(plain.output_text.split()) == 5
    assert plain.usage is not None and plain.usage.output_tokens == 5
    events = list(
        oai.responses.create(
            model="fake", input=[{"role": "user", "content": QUESTION}], max_output_tokens=6, stream=True
        )
    )
    kinds = [e.type for e in events]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and len(text.split()) == 6
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert {"response.output_item.added", "response.output_text.delta", "response.output_item.done"} <= set(kinds)
    calls = _calls(gateway, rollout["rollout_id"])
    _check_against_served(calls, fake_vllm.served)
    assert [c["api"] for c in calls] == ["responses", "responses"]
    assert calls[0]["request"]["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    assert calls[0]["response"]["message"]["content"] == plain.output_text
    assert calls[1]["response"]["message"]["content"] == text


async def test_responses_tool_round_trip_merges_like_chat(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, store: EventStore, run_id: str
) -> None:
    chat_rollout, chat_attempt = gateway.running(run_id, fake_vllm.url)
    await asyncio.to_thread(_chat_round_trip, chat_attempt)
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    oai, _ = _clients(attempt)

    def round_trip() -> str:
        items: Any = [{"role": "user", "content": QUESTION}]
        first = oai.responses.create(
            model="fake", instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS, max_output_tokens=4
        )
        call = next(item for item in first.output if item.type == "function_call")
        assert call.name == "search" and call.arguments.startswith('{"x":')
        items += [
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
        ]
        second = oai.responses.create(
            model="fake", instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS, max_output_tokens=4, stream=True
        )
        return "".join(e.delta for e in second if e.type == "response.output_text.delta")

    assert await asyncio.to_thread(round_trip)
    served = fake_vllm.served
    _check_against_served(_calls(gateway, rollout["rollout_id"]), served[2:])
    ours = await _samples(gateway, store, run_id, rollout["rollout_id"])
    assert ours == await _samples(gateway, store, run_id, chat_rollout["rollout_id"])
    assert sum(s[3] for s in ours) == 8  # both calls' sampled tokens, split the same way as over Chat Completions


def test_previous_response_id_continues_from_the_recorded_call(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    oai, _ = _clients(attempt)
    first = oai.responses.create(model="fake", input=QUESTION, tools=RESPONSES_TOOLS, max_output_tokens=4, store=False)
    call = next(item for item in first.output if item.type == "function_call")
    second = oai.responses.create(
        model="fake",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
        tools=RESPONSES_TOOLS,
        max_output_tokens=4,
    )
    assert second.output_text
    calls = _calls(gateway, rollout["rollout_id"])
    assert [m["role"] for m in calls[1]["request"]["messages"]] == ["user", "assistant", "tool"]
    assert calls[1]["prompt_ids"][: len(calls[0]["prompt_ids"])] == calls[0]["prompt_ids"]
    with pytest.raises(openai.NotFoundError, match="previous response"):
        oai.responses.create(model="fake", previous_response_id="resp_nope", input="x")
    _other_rollout, other = gateway.running(run_id, fake_vllm.url)
    with pytest.raises(openai.NotFoundError, match="previous response"):  # another attempt's call is not ours
        _clients(other)[0].responses.create(model="fake", previous_response_id=first.id, input="x")


def test_responses_reasoning_and_tools(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _rollout, attempt = gateway.running(run_id, fake_vllm.url)
    oai, _ = _clients(attempt)
    fake_vllm.reasoning = "let me think"
    answer = oai.responses.create(
        model="fake", input=QUESTION, reasoning={"effort": "low"}, include=["reasoning.encrypted_content"],
        tools=[*RESPONSES_TOOLS, {"type": "web_search"}], tool_choice="auto", parallel_tool_calls=False,
        max_output_tokens=3,
    )  # fmt: skip
    assert [item.type for item in answer.output] == ["reasoning", "function_call"]
    assert answer.output[0].content[0].text == "let me think"  # type: ignore[union-attr, index]
    streamed = list(oai.responses.create(model="fake", input=QUESTION, max_output_tokens=3, stream=True))
    assert any(e.type == "response.reasoning_text.delta" and e.delta == "let me think" for e in streamed)
    assert [i.type for i in streamed[-1].response.output] == ["reasoning", "message"]  # type: ignore[union-attr]
    assert fake_vllm.requests[0]["parallel_tool_calls"] is False
    assert [t["function"]["name"] for t in fake_vllm.requests[0]["tools"]] == ["search"]  # web_search dropped
    with pytest.raises(openai.UnprocessableEntityError, match="file_search"):
        oai.responses.create(model="fake", input="x", tools=[{"type": "file_search", "vector_store_ids": ["v"]}])


def test_anthropic_plain_streaming_and_thinking(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    _, claude = _clients(attempt)
    message = claude.messages.create(
        model="claude-sonnet-4-5", max_tokens=5, system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": QUESTION}], stop_sequences=["\n\n"],
    )  # fmt: skip
    assert message.stop_reason == "max_tokens" and message.model == "claude-sonnet-4-5"
    assert message.content[0].type == "text" and len(message.content[0].text.split()) == 5
    assert message.usage.output_tokens == 5
    with claude.messages.stream(
        model="claude-sonnet-4-5", max_tokens=6, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and len(text.split()) == 6  # type: ignore[union-attr]
    fake_vllm.reasoning = "hmm"
    thought = claude.messages.create(
        model="claude-sonnet-4-5", max_tokens=3, thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": QUESTION}],
    )  # fmt: skip
    assert [b.type for b in thought.content] == ["thinking", "text"] and thought.content[0].thinking == "hmm"  # type: ignore[union-attr]
    with claude.messages.stream(model="x", max_tokens=3, messages=[{"role": "user", "content": QUESTION}]) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    calls = _calls(gateway, rollout["rollout_id"])
    _check_against_served(calls, fake_vllm.served)
    assert {c["api"] for c in calls} == {"messages"}
    assert calls[0]["request"]["messages"][0] == {"role": "system", "content": SYSTEM}
    assert calls[0]["request"]["stop"] == ["\n\n"] and fake_vllm.requests[0]["stop"] == ["\n\n"]


async def test_anthropic_tool_round_trip_merges_like_chat(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, store: EventStore, run_id: str
) -> None:
    chat_rollout, chat_attempt = gateway.running(run_id, fake_vllm.url)
    await asyncio.to_thread(_chat_round_trip, chat_attempt)
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    _, claude = _clients(attempt)

    def round_trip() -> str:
        messages: Any = [{"role": "user", "content": QUESTION}]
        first = claude.messages.create(
            model="fake", max_tokens=4, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS
        )
        assert first.stop_reason == "tool_use"
        use = next(b for b in first.content if b.type == "tool_use")
        assert use.name == "search" and isinstance(use.input, dict)
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
        ]
        with claude.messages.stream(
            model="fake", max_tokens=4, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS
        ) as stream:
            return "".join(stream.text_stream)

    assert await asyncio.to_thread(round_trip)
    _check_against_served(_calls(gateway, rollout["rollout_id"]), fake_vllm.served[2:])
    ours = await _samples(gateway, store, run_id, rollout["rollout_id"])
    assert ours == await _samples(gateway, store, run_id, chat_rollout["rollout_id"])
    assert sum(s[3] for s in ours) == 8


def test_anthropic_streamed_tool_use(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _rollout, attempt = gateway.running(run_id, fake_vllm.url)
    _, claude = _clients(attempt)
    with claude.messages.stream(
        model="fake", max_tokens=4, messages=[{"role": "user", "content": QUESTION}], tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "search", "disable_parallel_tool_use": True},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].input == {"x": int(final.content[-1].input["x"])}  # type: ignore[union-attr,index]
    sent = fake_vllm.requests[0]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "search"}}
    assert sent["parallel_tool_calls"] is False


def test_anthropic_extras_and_errors(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _rollout, attempt = gateway.running(run_id, fake_vllm.url)
    _, claude = _clients(attempt)
    base = attempt["anthropic_base_url"]
    counted = claude.messages.count_tokens(
        model="fake", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    claude.messages.create(model="fake", max_tokens=1, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == len(fake_vllm.served[-1]["prompt_ids"]) > 0
    assert httpx.head(base).status_code == 200
    # `?beta=true` and an x-api-key header, as Claude Code sends them
    beta = claude.beta.messages.create(model="fake", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert beta.content[0].type == "text"
    assert "fake" in [m.id for m in claude.models.list().data]
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=base, api_key="wrong").messages.create(
            model="fake", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert denied.value.body["type"] == "error" and "token" in denied.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model="fake", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.UnprocessableEntityError, match="server tool"):
        claude.messages.create(
            model="fake", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )  # fmt: skip


def test_openai_errors_name_the_reason(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    _rollout, attempt = gateway.running(run_id, fake_vllm.url)
    with pytest.raises(openai.AuthenticationError, match="token"):
        openai.OpenAI(base_url=attempt["proxy_base_url"], api_key="wrong").responses.create(model="fake", input="hi")
    other = gateway.create(run_id)[0]
    url = (
        attempt["proxy_base_url"]
        .replace(attempt["attempt_id"], "nope")
        .replace(_rollout["rollout_id"], other["rollout_id"])
    )
    admin = openai.OpenAI(base_url=url, api_key=gateway.settings.admin_token)
    with pytest.raises(openai.NotFoundError, match="has no attempt nope") as missing:
        admin.responses.create(model="fake", input="hi")
    assert missing.value.body["type"] == "not_found_error"  # type: ignore[index]
    unserved = httpx.post(
        attempt["proxy_base_url"] + "/embeddings", headers={"authorization": f"Bearer {attempt['token']}"}
    )
    assert unserved.status_code == 404 and "responses" in unserved.json()["error"]["message"]
    gemini = attempt["proxy_base_url"].replace("/openai/v1", "/gemini/v1beta/models")
    assert "anthropic" in httpx.get(gemini).json()["error"]["message"]


def test_langchain_chat_openai_on_the_responses_api(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    llm = ChatOpenAI(
        model="fake", base_url=attempt["proxy_base_url"], api_key=attempt["token"], use_responses_api=True,
        max_tokens=4,  # type: ignore[call-arg]  # an alias of max_completion_tokens the stubs do not list
    )  # fmt: skip
    with_tools = llm.bind_tools(RESPONSES_TOOLS)
    first = with_tools.invoke([("system", SYSTEM), ("user", QUESTION)])
    assert first.tool_calls and first.tool_calls[0]["name"] == "search"
    history = [SystemMessage(SYSTEM), HumanMessage(QUESTION), first]
    history.append(ToolMessage(RESULT, tool_call_id=first.tool_calls[0]["id"]))
    second = "".join(str(chunk.text) for chunk in with_tools.stream(history))
    assert second
    calls = _calls(gateway, rollout["rollout_id"])
    _check_against_served(calls, fake_vllm.served)
    assert [c["api"] for c in calls] == ["responses", "responses"]
    assert [m["role"] for m in calls[1]["request"]["messages"]] == ["system", "user", "assistant", "tool"]


def test_a_run_maps_a_harness_model_name_by_alias(gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str) -> None:
    spec = {"run_id": run_id, "model_aliases": {"claude-sonnet-4-5": "judge"}}
    assert gateway.admin.post("/api/runs", json=spec).status_code == 201
    gateway.register_model(run_id, f"{fake_vllm.url}/v1", name="judge", served_model="judge-model")
    _rollout, attempt = gateway.running(run_id, fake_vllm.url, served_model="policy-model")
    _, claude = _clients(attempt)
    for name in ("claude-sonnet-4-5", "fake", "judge"):
        claude.messages.create(model=name, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert [r["model"] for r in fake_vllm.requests] == ["judge-model", "policy-model", "judge-model"]


def test_refusals_of_an_ended_attempt_and_a_large_body_in_each_shape(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    oai, claude = _clients(attempt)
    huge = "x" * (gateway.settings.max_body_bytes + 1)
    with pytest.raises(openai.APIStatusError, match="larger than the limit") as big:
        oai.responses.create(model="fake", input=huge)
    assert big.value.status_code == 413 and big.value.body["type"] == "request_too_large"  # type: ignore[index]
    with pytest.raises(anthropic.APIStatusError, match="larger than the limit") as big_claude:
        claude.messages.create(model="fake", max_tokens=1, messages=[{"role": "user", "content": huge}])
    assert big_claude.value.status_code == 413 and big_claude.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    for status in ("running", "succeeded"):
        gateway.admin.patch(f"/api/rollouts/{rollout['rollout_id']}", json={"status": status})
    with pytest.raises(openai.ConflictError, match="has ended") as ended:
        oai.responses.create(model="fake", input="hi")
    assert ended.value.body["current"]["status"] == "succeeded"  # type: ignore[index]
    with pytest.raises(anthropic.ConflictError, match="has ended"):
        claude.messages.create(model="fake", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert fake_vllm.started == 0
