"""The one conversation type every front end translates into, and the one answer it translates back.

Chat Completions, the Responses API and Anthropic's Messages API all describe the same thing: a
list of turns (system, user, assistant with text / reasoning / tool calls, tool results), function
tools, and sampling limits. `Conversation` holds that, and `chat_body()` writes it as the engine's
chat-completions request (the request the proxy records, so merge, replay and the viewer see the
same shape whatever API a call came through). `Output` is one choice of the engine's answer, read
from the recorded `ChoiceRecord`, that each front end renders in its own format. Pure, no I/O.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.proxy.openai_format import ChoiceRecord, reasoning_of

_encode = msgspec.json.Encoder().encode


class TranslationError(Exception):
    """The request cannot be expressed for the engine; `field` names where (a 4xx in the API's shape)."""

    def __init__(self, message: str, field: str, status: int = 422) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.status = status


def listed(request: dict[str, Any], name: str) -> list[Any]:
    """`request[name]` as a list (absent or null: empty); a 422 naming it when it is anything else."""
    value = request.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise TranslationError(f'"{name}" must be a list, not {type(value).__name__}', name)
    return value


class ToolCall(msgspec.Struct, frozen=True):
    """A function call the model made: its id, the function's name, JSON arguments as text."""

    id: str
    name: str
    arguments: str


class Turn(msgspec.Struct, kw_only=True):
    """One message: `content` is text or a list of chat content parts (text, image_url)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    tool_call_id: str | None = None

    def chat(self) -> dict[str, Any]:
        """The turn as a chat-completions message."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class Tool(msgspec.Struct, frozen=True):
    """A function tool: name, description, JSON Schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Conversation(msgspec.Struct, kw_only=True):
    """A model call in API-neutral form (see the module docstring)."""

    model: str | None
    turns: list[Turn]
    tools: list[Tool] = msgspec.field(default_factory=list)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    response_format: dict[str, Any] | None = None
    stream: bool = False
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    def chat_body(self) -> dict[str, Any]:
        """The engine's chat-completions request for this conversation (extras not yet added)."""
        body: dict[str, Any] = {"model": self.model, "messages": [t.chat() for t in self.turns]}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": msgspec.structs.asdict(t) | {"parameters": t.parameters or {}}}
                for t in self.tools
            ]
        optional = {
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop or None,
            "response_format": self.response_format,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        body.update(self.extra)
        if self.stream:
            body["stream"] = True
        return body


def append_tool_call(turns: list[Turn], call: ToolCall) -> None:
    """Add a tool call to the last assistant turn, or start one (APIs list calls as separate items)."""
    if turns and turns[-1].role == "assistant" and turns[-1].tool_call_id is None:
        turns[-1].tool_calls.append(call)
    else:
        turns.append(Turn(role="assistant", tool_calls=[call]))


def json_text(value: Any) -> str:
    """A value as JSON text (tool arguments); text stays text."""
    return value if isinstance(value, str) else _encode(value).decode()


def history(request: dict[str, Any], response: dict[str, Any]) -> list[Turn]:
    """The turns of a recorded call followed by its answer (to continue from `previous_response_id`)."""
    messages = list(request.get("messages") or [])
    message = response.get("message")
    if isinstance(message, dict):
        messages.append(message)
    try:
        return [_turn(m) for m in messages if isinstance(m, dict)]
    except (msgspec.ValidationError, TypeError, KeyError) as exc:
        raise TranslationError(f"the recorded call cannot be continued: {exc}", "previous_response_id") from None


def _turn(message: dict[str, Any]) -> Turn:
    calls = [
        ToolCall(str(c["id"]), str(c["function"]["name"]), json_text(c["function"].get("arguments") or ""))
        for c in message.get("tool_calls") or []
    ]
    return Turn(
        role=str(message["role"]),
        content=message.get("content"),
        reasoning=reasoning_of(message) or None,
        tool_calls=calls,
        tool_call_id=message.get("tool_call_id"),
    )


class Output(msgspec.Struct, kw_only=True):
    """One choice of the engine's answer: text, reasoning, tool calls, why it stopped, token counts."""

    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str | None
    stop_sequence: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0


def output_of(record: ChoiceRecord | None, usage: dict[str, Any] | None, stop_reason: Any = None) -> Output:
    """The answer of one recorded choice (none recorded: an empty answer)."""
    counts = usage if isinstance(usage, dict) else {}
    tokens = (int(counts.get("prompt_tokens") or 0), int(counts.get("completion_tokens") or 0))
    if record is None:
        return Output(text="", reasoning="", tool_calls=[], finish_reason=None, input_tokens=tokens[0])
    message = record.response()["message"]
    calls = [
        ToolCall(
            str(c.get("id") or ""),
            str(c["function"].get("name") or ""),
            json_text(c["function"].get("arguments") or ""),
        )
        for c in message.get("tool_calls") or []
        if isinstance(c, dict) and isinstance(c.get("function"), dict)
    ]
    content = message.get("content")
    return Output(
        text=content if isinstance(content, str) else "",
        reasoning=reasoning_of(message),
        tool_calls=calls,
        finish_reason=record.finish_reason,
        stop_sequence=stop_reason if isinstance(stop_reason, str) else None,
        input_tokens=tokens[0],
        output_tokens=tokens[1] or len(record.token_ids),
    )
