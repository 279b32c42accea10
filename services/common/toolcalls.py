"""Parsing generated text into an assistant message: Hermes-style tool calls and `<think>` reasoning.

The gateway parses what it gets back from a token-in completion (continuous prompt mode) with it,
so the message is the one vLLM's Hermes tool parser and reasoning parser give for a chat call.

A model following the chat template answers a tool call as

    optional text<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>  (one block per call)

`parse_tool_calls` returns the text before the first block as content and the calls in OpenAI's
shape (`arguments` is a JSON string). The last block may lack its closing tag (generation stopped
right after the JSON). If any block is not a JSON object with a string `name` and an object (or
JSON string) `arguments`, nothing is parsed: the whole text stays content, as vLLM's Hermes parser
does. Text after the last block is dropped.

`split_reasoning` separates a leading `<think>…</think>` block (Qwen3, DeepSeek-R1 style) from the answer.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import msgspec

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


class FunctionCall(msgspec.Struct, frozen=True):
    """A function name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True):
    """One tool call of an assistant message, as OpenAI returns it."""

    id: str
    function: FunctionCall
    type: str = "function"


class ParsedOutput(msgspec.Struct, frozen=True):
    """Content (None when empty) and the tool calls found in a generated text."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]


def _arguments_json(arguments: Any) -> str | None:
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            return arguments if isinstance(json.loads(arguments), dict) else None
        except ValueError:
            return None
    return None


def _parse_block(body: str) -> FunctionCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = _arguments_json(call.get("arguments", {}))
    return None if arguments is None else FunctionCall(name=call["name"], arguments=arguments)


def new_tool_call_id() -> str:
    """A fresh tool call id (`call_` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split generated text into content and Hermes tool calls (see the module docstring)."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return ParsedOutput(content=text or None, tool_calls=())
    calls: list[ToolCall] = []
    for match in _BLOCK.finditer(text, start):
        function = _parse_block(match.group(1).strip())
        if function is None:
            return ParsedOutput(content=text or None, tool_calls=())
        calls.append(ToolCall(id=new_tool_call_id(), function=function))
    return ParsedOutput(content=text[:start] or None, tool_calls=tuple(calls))


THINK_START = "<think>"
THINK_END = "</think>"


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, answer) of generated text that opens with a `<think>…</think>` block, both as sampled.

    Text that does not open with `<think>` (leading whitespace aside) has no reasoning; a block never
    closed is all reasoning (the model stopped while thinking).
    """
    stripped = text.lstrip()
    if not stripped.startswith(THINK_START):
        return "", text
    start = len(text) - len(stripped) + len(THINK_START)
    end = text.find(THINK_END, start)
    if end < 0:
        return text[start:], ""
    return text[start:end], text[end + len(THINK_END) :]


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: text a
    stream must hold until the next piece decides whether a marker (`<tool_call>`, a stop string) starts."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
