"""OpenAI's Responses API (`POST .../openai/v1/responses`) over the engine's chat completions.

Request: `instructions` (a system turn first), `input` (text, or items: messages with text or
image parts, `function_call`, `function_call_output`, `reasoning`), function `tools`,
`tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`,
`text.format` (JSON schema). `reasoning`, `store`, `include`, `metadata`, `prompt_cache_key`,
`client_metadata`, `truncation`, `user`, `service_tier` are accepted and change nothing (the
engine decides whether the model reasons; the proxy keeps no response store of its own).
`previous_response_id` continues from a call this attempt made: its recorded request and answer
(ids are `resp_<call_id>`).

Tools the engine cannot run: `web_search` / `web_search_preview` and `namespace`, which Codex CLI
sends with every request, are dropped; any other non-function tool is refused with a 422 naming it.

Answer: a `response` object whose output holds a `reasoning` item (when the model produced
reasoning text), a `message` with `output_text`, and one `function_call` item per tool call.
Streamed: `response.created`, `response.in_progress`, then per item `response.output_item.added`
and its deltas (`response.reasoning_text.delta`, `response.content_part.added` +
`response.output_text.delta`, `response.function_call_arguments.delta`); the `...done` events and
`response.completed` (or `response.incomplete`) follow once the call is recorded.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from services.gateway.proxy.frontends.base import Api, error_body, sse, upstream_message
from services.gateway.proxy.frontends.canonical import (
    Conversation,
    Output,
    Tool,
    ToolCall,
    TranslationError,
    Turn,
    append_tool_call,
    json_text,
    listed,
    output_of,
)
from services.gateway.proxy.openai_format import ChoiceRecord, StreamFold, reasoning_of

_encode = msgspec.json.Encoder().encode
DROPPED_TOOLS = frozenset({"web_search", "web_search_preview", "namespace"})
_ROLES = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}


def _text_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TranslationError(f"{where}.content must be text or a list of parts", where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "reasoning_text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind != "refusal":
            raise TranslationError(f"content part type {kind!r} is not supported", f"{where}.content[{i}]")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _item(turns: list[Turn], item: Any, where: str, pending: list[str]) -> None:
    if not isinstance(item, dict):
        raise TranslationError("each input item must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLES.get(str(item.get("role")))
        if role is None:
            raise TranslationError(f"message role {item.get('role')!r} is not one of {sorted(_ROLES)}", f"{where}.role")
        turn = Turn(role=role, content=_text_parts(item.get("content"), where))
        if role == "assistant" and pending:
            turn.reasoning = "".join(pending)
            pending.clear()
        turns.append(turn)
    elif kind == "function_call":
        append_tool_call(
            turns, ToolCall(str(item.get("call_id")), str(item.get("name")), json_text(item.get("arguments", "")))
        )
        if pending:
            turns[-1].reasoning, pending[:] = "".join(pending), []
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text_parts(output, where)
        turns.append(Turn(role="tool", content=text, tool_call_id=str(item.get("call_id"))))
    elif kind == "reasoning":
        texts = [p.get("text", "") for p in (item.get("content") or []) if isinstance(p, dict)]
        pending.append("".join(str(t) for t in texts))
    else:
        raise TranslationError(
            f"input item type {kind!r} is not supported (use message, function_call, function_call_output, reasoning)",
            where,
        )


def _turns(request: dict[str, Any], prior: list[Turn]) -> list[Turn]:
    turns: list[Turn] = []
    instructions = request.get("instructions")
    if isinstance(instructions, str) and instructions:
        turns.append(Turn(role="system", content=instructions))
    turns += [t for t in prior if not (t.role == "system" and turns)]
    items = request.get("input")
    if isinstance(items, str):
        turns.append(Turn(role="user", content=items))
    elif isinstance(items, list):
        pending: list[str] = []
        for i, item in enumerate(items):
            _item(turns, item, f"input[{i}]", pending)
    elif items is not None:
        raise TranslationError('"input" must be text or a list of items', "input")
    if not turns:
        raise TranslationError('a response needs "input"', "input")
    return turns


def _tools(request: dict[str, Any]) -> list[Tool]:
    tools: list[Tool] = []
    for i, tool in enumerate(listed(request, "tools")):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in DROPPED_TOOLS:
            continue
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise TranslationError(
                f"tool type {kind!r} cannot be served by this model endpoint; only function tools can", f"tools[{i}]"
            )
        tools.append(Tool(tool["name"], tool.get("description"), tool.get("parameters")))
    return tools


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return choice.get("mode", "auto")
    raise TranslationError(f"tool_choice {choice!r} is not supported", "tool_choice")


def conversation(request: dict[str, Any], prior: list[Turn]) -> Conversation:
    """The canonical conversation of a Responses request (`prior`: the previous response's turns)."""
    tools = _tools(request)
    text = request.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    response_format = None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        response_format = {"type": "json_object"}
    return Conversation(
        model=request.get("model") if isinstance(request.get("model"), str) else None,
        turns=_turns(request, prior),
        tools=tools,
        tool_choice=_tool_choice(request.get("tool_choice")) if tools else None,
        parallel_tool_calls=request.get("parallel_tool_calls") if tools else None,
        max_tokens=request.get("max_output_tokens"),
        temperature=request.get("temperature"),
        top_p=request.get("top_p"),
        response_format=response_format,
        stream=bool(request.get("stream")),
    )


def _usage(out: Output) -> dict[str, Any]:
    return {
        "input_tokens": out.input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.input_tokens + out.output_tokens,
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


class _Open(msgspec.Struct):
    """An output item being streamed: its kind, id, and text so far (arguments for a call)."""

    kind: str
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""

    def item(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return _reasoning_item(self.id, self.text)
        if self.kind == "message":
            return _message_item(self.id, self.text)
        return _call_item(self.id, ToolCall(self.call_id, self.name, self.text))


class ResponsesTranslator:
    """Writes the engine's answer as a Responses API `response` (see the module docstring)."""

    api: Api = "openai"

    def __init__(self, request: dict[str, Any], call_id: str, model: str) -> None:
        self.request, self.call_id, self.model = request, call_id, model
        self.created = int(time.time())
        self.seq = 0
        self.items: list[_Open] = []
        self.calls: dict[int, _Open] = {}

    def response(self, status: str, output: list[dict[str, Any]], out: Output | None) -> dict[str, Any]:
        """The `response` object (`out` None while in progress)."""
        request = self.request
        incomplete = out is not None and out.finish_reason == "length"
        return {
            "id": f"resp_{self.call_id}",
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "model": self.model,
            "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "instructions": request.get("instructions"),
            "metadata": request.get("metadata") or {},
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": request.get("tools") or [],
            "temperature": request.get("temperature"),
            "top_p": request.get("top_p"),
            "previous_response_id": request.get("previous_response_id"),
            "reasoning": request.get("reasoning"),
            "store": request.get("store", True),
            "text": request.get("text") or {"format": {"type": "text"}},
            "usage": _usage(out) if out is not None else None,
        }

    def complete(self, answer: dict[str, Any], content: bytes | None, records: list[ChoiceRecord]) -> bytes:
        """The whole `response`."""
        out = output_of(records[0] if records else None, answer.get("usage"))
        output: list[dict[str, Any]] = []
        if out.reasoning:
            output.append(_reasoning_item(f"rs_{self.call_id}", out.reasoning))
        if out.text or not out.tool_calls:
            output.append(_message_item(f"msg_{self.call_id}", out.text))
        output += [_call_item(f"fc_{self.call_id}_{i}", c) for i, c in enumerate(out.tool_calls)]
        return _encode(self.response("completed", output, out))

    def _event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return sse(kind, {"type": kind, "sequence_number": self.seq, **data})

    def begin(self) -> bytes:
        """`response.created` and `response.in_progress`."""
        skeleton = self.response("in_progress", [], None)
        return self._event("response.created", response=skeleton) + self._event(
            "response.in_progress", response=skeleton
        )

    def _open(self, kind: str, item_id: str, **fields: str) -> tuple[_Open, bytes]:
        item = _Open(kind, item_id, **fields)
        self.items.append(item)
        index = len(self.items) - 1
        added = item.item() | ({"status": "in_progress"} if kind != "reasoning" else {})
        if kind == "message":
            added["content"] = []
        if kind == "reasoning":
            added["content"] = []
        out = self._event("response.output_item.added", output_index=index, item=added)
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part
            )
        return item, out

    def _current(self, kind: str, prefix: str) -> tuple[_Open, int, bytes]:
        if self.items and self.items[-1].kind == kind:
            return self.items[-1], len(self.items) - 1, b""
        item, out = self._open(kind, f"{prefix}_{self.call_id}_{len(self.items)}")
        return item, len(self.items) - 1, out

    def chunk(self, chunk: dict[str, Any], data: bytes) -> tuple[bytes, bytes]:
        """Deltas of choice 0 as Responses events (new items opened as they start)."""
        out = b""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) and choice.get("index", 0) == 0 else None
            if not isinstance(delta, dict):
                continue
            reasoning = reasoning_of(delta)
            if reasoning:
                item, index, opened = self._current("reasoning", "rs")
                item.text += reasoning
                out += opened + self._event(
                    "response.reasoning_text.delta",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    delta=reasoning,
                )
            text = delta.get("content")
            if isinstance(text, str) and text:
                item, index, opened = self._current("message", "msg")
                item.text += text
                out += opened + self._event(
                    "response.output_text.delta",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
        return out, b""

    def _call_delta(self, call: Any) -> bytes:
        if not isinstance(call, dict):
            return b""
        key = int(call.get("index", 0))
        function: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
        out = b""
        item = self.calls.get(key)
        if item is None:
            call_id = str(call.get("id") or f"call_{self.call_id}_{key}")
            item, out = self._open(
                "function_call", f"fc_{self.call_id}_{key}", call_id=call_id, name=str(function.get("name") or "")
            )
            self.calls[key] = item
        elif function.get("name"):
            item.name += function["name"]
        arguments = function.get("arguments") or ""
        if arguments:
            item.text += arguments
            out += self._event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=self.items.index(item),
                delta=arguments,
            )
        return out

    def end(self, fold: StreamFold) -> bytes:
        """Every item's `...done` events, then `response.completed` (or `response.incomplete`)."""
        records = fold.records()
        out_bytes = b"" if self.items else self._open("message", f"msg_{self.call_id}_0")[1]
        for index, item in enumerate(self.items):
            if item.kind == "reasoning":
                out_bytes += self._event(
                    "response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0, text=item.text
                )
            elif item.kind == "message":
                part = {"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}
                out_bytes += self._event(
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=item.text,
                    logprobs=[],
                )
                out_bytes += self._event(
                    "response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part
                )
            else:
                out_bytes += self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=item.text,
                    name=item.name,
                )
            out_bytes += self._event("response.output_item.done", output_index=index, item=item.item())
        out = output_of(records[0] if records else None, fold.usage)
        response = self.response("completed", [i.item() for i in self.items], out)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out_bytes + self._event(kind, response=response)

    def upstream_error(self, status: int, content: bytes) -> bytes:
        """The engine's error as an OpenAI error object."""
        return error_body("openai", status, upstream_message(content, status))

    def stream_error(self, status: int, message: str) -> bytes:
        """An `error` event."""
        return self._event("error", code=str(status), message=message, param=None)
