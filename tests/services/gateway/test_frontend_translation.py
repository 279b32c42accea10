"""The Responses and Messages front ends' translation into the canonical conversation: pure functions."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.proxy.frontends import messages, responses
from services.gateway.proxy.frontends.canonical import TranslationError, Turn, history

IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AA"}
THOUGHT = {"type": "reasoning_text", "text": "hm"}
USER = [{"role": "user", "content": "x"}]


def _chat(conv: Any) -> list[dict[str, Any]]:
    return conv.chat_body()["messages"]  # type: ignore[no-any-return]


def test_responses_items_become_chat_turns() -> None:
    conv = responses.conversation(
        {
            "model": "m", "instructions": "sys",
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"}, IMAGE]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [THOUGHT]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
            ],
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
            "tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "namespace", "name": "n"}],
            "tool_choice": {"type": "function", "name": "f"}, "max_output_tokens": 9, "store": False,
        },
        [],
    )  # fmt: skip
    turns = _chat(conv)
    assert [t["role"] for t in turns] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert turns[2]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    assert [c["function"]["name"] for c in turns[3]["tool_calls"]] == ["f", "g"]  # one assistant turn, two calls
    assert turns[3]["reasoning_content"] == "hm" and turns[3]["content"] is None
    assert (turns[4]["tool_call_id"], turns[5]["content"]) == ("c1", "two")
    body = conv.chat_body()
    assert body["response_format"]["json_schema"]["name"] == "out" and body["max_tokens"] == 9
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert [t["function"]["name"] for t in body["tools"]] == ["f"]  # the namespace tool dropped


@pytest.mark.parametrize(
    ("request_body", "field"),
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0]"),
        ({"input": 3}, "input"),
        ({}, "input"),
    ],
)
def test_responses_refusals_name_the_field(request_body: dict[str, Any], field: str) -> None:
    with pytest.raises(TranslationError) as refused:
        responses.conversation(request_body, [])
    assert refused.value.field == field


def test_previous_response_turns_come_first() -> None:
    prior = history(
        {"messages": [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]},
        {"message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}},
    )  # fmt: skip
    conv = responses.conversation(
        {"instructions": "new", "input": [{"type": "function_call_output", "call_id": "c1", "output": "r"}]}, prior
    )
    assert [(t["role"], t["content"]) for t in _chat(conv)] == [
        ("system", "new"), ("user", "q"), ("assistant", None), ("tool", "r")
    ]  # fmt: skip
    assert isinstance(prior[0], Turn)


def test_messages_blocks_become_chat_turns() -> None:
    conv = messages.conversation(
        {
            "model": "claude-x", "max_tokens": 5, "system": [{"type": "text", "text": t} for t in "ab"],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                 {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "let me"},
                 {"type": "tool_use", "id": "u1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u1",
                 "content": [{"type": "text", "text": "res"}]}, {"type": "text", "text": "go on"}]},
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"], "top_k": 4, "thinking": {"type": "enabled", "budget_tokens": 10},
        }
    )  # fmt: skip
    turns = _chat(conv)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool", "user"]
    assert turns[0]["content"] == "ab"
    assert turns[1]["content"][1]["image_url"]["url"] == "data:image/png;base64,AA"
    assert (turns[2]["content"], turns[2]["reasoning_content"]) == ("let me", "t")
    assert turns[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a":1}'}
    assert (turns[3]["tool_call_id"], turns[3]["content"], turns[4]["content"]) == ("u1", "res", "go on")
    body = conv.chat_body()
    assert (body["tool_choice"], body["parallel_tool_calls"], body["stop"], body["top_k"]) == (
        "required",
        False,
        ["END"],
        4,
    )


@pytest.mark.parametrize(
    ("request_body", "field"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 1, "messages": []}, "messages"),
        ({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"max_tokens": 1, "messages": USER, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
        ({"max_tokens": 1, "messages": USER, "stop_sequences": "END"}, "stop_sequences"),
    ],
)  # fmt: skip
def test_messages_refusals_name_the_field(request_body: dict[str, Any], field: str) -> None:
    with pytest.raises(TranslationError) as refused:
        messages.conversation(request_body)
    assert refused.value.field == field
