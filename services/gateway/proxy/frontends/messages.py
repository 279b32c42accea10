"""Anthropic's Messages API (`POST .../anthropic/v1/messages`) over the engine's chat completions.

Request: `system` (text or text blocks), `messages` (user, assistant, and system turns as
Claude Code sends them between the others) whose content is text or blocks (`text`,
`image` as base64 or URL, `tool_use`, `tool_result`, `thinking`; `redacted_thinking` is dropped),
`tools` (name, description, input_schema), `tool_choice` (auto / any / tool / none,
`disable_parallel_tool_use`), `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`.
`thinking`, `metadata`, `context_management`, `output_config`, `service_tier` are accepted and
change nothing. Server tools (a `type` such as `web_search_20250305`) are refused with a 400.

Answer: a `message` whose content holds a `thinking` block (when the model produced reasoning
text), a `text` block, and one `tool_use` block per tool call; `stop_reason` is `end_turn`,
`max_tokens`, `stop_sequence` or `tool_use`. Streamed: `message_start`, then per block
`content_block_start` and its deltas (`thinking_delta`, `text_delta`, `input_json_delta`), with
`content_block_stop` when the next block starts; the last `content_block_stop`,
`message_delta` and `message_stop` follow once the call is recorded. The `model` in the answer
is the name the client asked for.
"""

from __future__ import annotations

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
    json_text,
    listed,
    output_of,
)
from services.gateway.proxy.openai_format import ChoiceRecord, StreamFold, reasoning_of

_encode = msgspec.json.Encoder().encode
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
SIGNATURE = "rollwire"  # thinking blocks need a signature; the engine's reasoning has none


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") == "text")
    raise TranslationError(f"{where} must be text or a list of text blocks", where)


def _image(block: dict[str, Any]) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    else:
        url = str(source.get("url"))
    return {"type": "image_url", "image_url": {"url": url}}


def _user(turns: list[Turn], content: list[Any], where: str) -> None:
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            turns.append(
                Turn(
                    role="tool",
                    content=_text(block.get("content", ""), f"{where}[{i}].content"),
                    tool_call_id=str(block.get("tool_use_id")),
                )
            )
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append(_image(block))
        elif kind not in ("document", "search_result"):
            raise TranslationError(f"block type {kind!r} is not supported in a user turn", f"{where}[{i}]")
    if parts:
        plain = all(p["type"] == "text" for p in parts)
        turns.append(Turn(role="user", content="".join(p["text"] for p in parts) if plain else parts))


def _assistant(content: list[Any], where: str) -> Turn:
    turn = Turn(role="assistant")
    texts: list[str] = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            turn.reasoning = (turn.reasoning or "") + str(block.get("thinking", ""))
        elif kind == "tool_use":
            turn.tool_calls.append(
                ToolCall(str(block.get("id")), str(block.get("name")), json_text(block.get("input", {})))
            )
        elif kind != "redacted_thinking":
            raise TranslationError(f"block type {kind!r} is not supported in an assistant turn", f"{where}[{i}]")
    turn.content = "".join(texts) if texts else None
    return turn


def _turns(request: dict[str, Any]) -> list[Turn]:
    turns: list[Turn] = []
    system = request.get("system")
    if system:
        turns.append(Turn(role="system", content=_text(system, "system")))
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TranslationError('messages need a non-empty list of "messages"', "messages")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        where = f"messages[{i}].content"
        if role not in ("user", "assistant", "system") or not isinstance(content, (str, list)):
            raise TranslationError("each message needs role user, assistant or system, and content", f"messages[{i}]")
        if role == "system":
            turns.append(Turn(role="system", content=_text(content, where)))
        elif isinstance(content, str):
            turns.append(Turn(role=role, content=content))
        elif role == "user":
            _user(turns, content, where)
        else:
            turns.append(_assistant(content, where))
    return turns


def _tools(request: dict[str, Any]) -> list[Tool]:
    tools = []
    for i, tool in enumerate(listed(request, "tools")):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise TranslationError("each tool needs a name", f"tools[{i}]")
        if tool.get("type") not in (None, "custom"):
            raise TranslationError(
                f"server tool {tool.get('type')!r} cannot be served by this model endpoint; only client tools can",
                f"tools[{i}]",
            )
        tools.append(Tool(tool["name"], tool.get("description"), tool.get("input_schema")))
    return tools


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    if not isinstance(choice, dict):
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    if mapped is None:
        raise TranslationError(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")
    return mapped, parallel


def conversation(request: dict[str, Any]) -> Conversation:
    """The canonical conversation of a Messages request."""
    max_tokens = request.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise TranslationError("max_tokens must be a positive integer", "max_tokens", status=400)
    tools = _tools(request)
    choice, parallel = _tool_choice(request.get("tool_choice")) if tools else (None, None)
    stops = request.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise TranslationError("stop_sequences must be a list of strings", "stop_sequences", status=400)
    top_k = request.get("top_k")
    return Conversation(
        model=request.get("model") if isinstance(request.get("model"), str) else None,
        turns=_turns(request),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        max_tokens=max_tokens,
        temperature=request.get("temperature"),
        top_p=request.get("top_p"),
        stop=stops,
        stream=bool(request.get("stream")),
        extra={"top_k": top_k} if top_k is not None else {},  # checked with the other sampling parameters
    )


def _usage(out: Output) -> dict[str, int]:
    return {
        "input_tokens": out.input_tokens,
        "output_tokens": out.output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _stop_reason(out: Output) -> str:
    if out.finish_reason == "stop" and out.stop_sequence:
        return "stop_sequence"
    return _STOP.get(str(out.finish_reason), "end_turn")


def _input(arguments: str) -> Any:
    try:
        return msgspec.json.decode(arguments or "{}")
    except msgspec.DecodeError:
        return {"_raw": arguments}  # the model wrote arguments that are not JSON: pass them on, visibly


def _blocks(out: Output) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": SIGNATURE})
    if out.text or not out.tool_calls:
        blocks.append({"type": "text", "text": out.text})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)} for c in out.tool_calls]
    return blocks


class MessagesTranslator:
    """Writes the engine's answer as an Anthropic `message` (see the module docstring)."""

    api: Api = "anthropic"

    def __init__(self, call_id: str, model: str) -> None:
        self.call_id, self.model = call_id, model
        self.kinds: list[str] = []  # the kind of each block started so far
        self.calls: dict[int, int] = {}  # tool call index -> block index
        self.stop_reason: Any = None

    def message(self, content: list[dict[str, Any]], out: Output | None) -> dict[str, Any]:
        """The `message` object (`out` None at `message_start`)."""
        usage = _usage(out) if out is not None else {"input_tokens": 0, "output_tokens": 0}
        return {
            "id": f"msg_{self.call_id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": _stop_reason(out) if out is not None else None,
            "stop_sequence": out.stop_sequence if out is not None else None,
            "usage": usage,
        }

    def complete(self, answer: dict[str, Any], content: bytes | None, records: list[ChoiceRecord]) -> bytes:
        """The whole `message`."""
        choices = answer.get("choices") or [{}]
        stop = choices[0].get("stop_reason") if isinstance(choices[0], dict) else None
        out = output_of(records[0] if records else None, answer.get("usage"), stop)
        return _encode(self.message(_blocks(out), out))

    def begin(self) -> bytes:
        """`message_start`."""
        return sse("message_start", {"type": "message_start", "message": self.message([], None)})

    def _stop(self) -> bytes:
        index = len(self.kinds) - 1
        out = b""
        if self.kinds[index] == "thinking":
            out += self._delta(index, {"type": "signature_delta", "signature": SIGNATURE})
        return out + sse("content_block_stop", {"type": "content_block_stop", "index": index})

    def _start(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._stop() if self.kinds else b""
        self.kinds.append(kind)
        return out + sse(
            "content_block_start", {"type": "content_block_start", "index": len(self.kinds) - 1, "content_block": block}
        )

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def chunk(self, chunk: dict[str, Any], data: bytes) -> tuple[bytes, bytes]:
        """Deltas of choice 0 as content block events."""
        out = b""
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if choice.get("stop_reason") is not None:
                self.stop_reason = choice["stop_reason"]
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            reasoning = reasoning_of(delta)
            if reasoning:
                if not self.kinds or self.kinds[-1] != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out += self._delta(len(self.kinds) - 1, {"type": "thinking_delta", "thinking": reasoning})
            text = delta.get("content")
            if isinstance(text, str) and text:
                if not self.kinds or self.kinds[-1] != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out += self._delta(len(self.kinds) - 1, {"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
        return out, b""

    def _call_delta(self, call: Any) -> bytes:
        if not isinstance(call, dict):
            return b""
        key = int(call.get("index", 0))
        function: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
        out = b""
        if key not in self.calls:
            block = {
                "type": "tool_use",
                "id": str(call.get("id") or f"toolu_{self.call_id}_{key}"),
                "name": str(function.get("name") or ""),
                "input": {},
            }
            out += self._start("tool_use", block)
            self.calls[key] = len(self.kinds) - 1
        if function.get("arguments"):
            out += self._delta(self.calls[key], {"type": "input_json_delta", "partial_json": function["arguments"]})
        return out

    def end(self, fold: StreamFold) -> bytes:
        """The last `content_block_stop`, `message_delta` and `message_stop`."""
        records = fold.records()
        out = output_of(records[0] if records else None, fold.usage, self.stop_reason)
        tail = b""
        if not self.kinds:
            tail += self._start("text", {"type": "text", "text": ""})
        tail += self._stop()
        delta = {"stop_reason": _stop_reason(out), "stop_sequence": out.stop_sequence}
        tail += sse("message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(out)})
        return tail + sse("message_stop", {"type": "message_stop"})

    def upstream_error(self, status: int, content: bytes) -> bytes:
        """The engine's error in Anthropic's shape."""
        return error_body("anthropic", status, upstream_message(content, status))

    def stream_error(self, status: int, message: str) -> bytes:
        """An `error` event."""
        body = msgspec.json.decode(error_body("anthropic", status, message))
        return sse("error", body)


def count_body(conv: Conversation, upstream_model: str) -> dict[str, Any]:
    """The one-token engine request whose `prompt_token_ids` count the conversation's input tokens."""
    body = conv.chat_body() | {"model": upstream_model, "max_tokens": 1, "return_token_ids": True}
    body.pop("stream", None)
    return body
