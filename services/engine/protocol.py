"""The wire format: OpenAI chat-completions requests (with vLLM's extras) and vLLM-shaped responses.

Requests are decoded with msgspec; a malformed field becomes a `RequestError` naming it, which the
server answers as `{"error": {"message", "type", "param", "code"}}` with status 400 (404 for an
unknown model). Fields OpenAI clients may send that the engine cannot honour differently from the
default (`presence_penalty`, `frequency_penalty`, `parallel_tool_calls`, `user`, ...) are accepted
and ignored; options that would change the output and are not implemented (`tool_choice:
"required"`, `response_format` other than text) are refused rather than silently ignored.

vLLM extras understood: `return_token_ids` (top-level `prompt_token_ids`, per-choice `token_ids`),
`top_k`, `stop_token_ids`, `ignore_eos`, `chat_template_kwargs`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from services.common.toolcalls import ToolCall
from services.engine.output import LogprobEntry
from services.engine.sampling import SamplingParams

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the engine refuses; rendered as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str = "invalid_value",
        status: int = 400,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        """The JSON error body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


# ---- requests -------------------------------------------------------------------------------------


class ContentPart(msgspec.Struct):
    """One part of a multi-part message content; only text parts are supported."""

    type: str
    text: str | UnsetType = UNSET


class FunctionCallIn(msgspec.Struct):
    """A function call in an assistant message of the conversation."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(msgspec.Struct):
    """A tool call in an assistant message of the conversation."""

    function: FunctionCallIn
    id: str | UnsetType = UNSET
    type: str = "function"


class Message(msgspec.Struct):
    """A conversation message."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | UnsetType = UNSET
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | UnsetType = UNSET


class StreamOptions(msgspec.Struct):
    """`stream_options`: only `include_usage` changes anything."""

    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct):
    """POST /v1/chat/completions body (unknown fields are ignored)."""

    messages: list[Message]
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # kept as sent: templates see the client's JSON
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    return_token_ids: bool | None = False
    ignore_eos: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class ReloadRequest(msgspec.Struct):
    """POST /reload body: a saved model directory and the weights version it holds."""

    path: str
    weights_version: int


_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_reload_decoder = msgspec.json.Decoder(ReloadRequest)
_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode_with(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """Decode a request body with `decoder`, or raise RequestError naming the bad field."""
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        missing = re.search(r"missing required field `([^`]*)`", str(exc))
        param = match.group(1) if match else (missing.group(1) if missing else None)
        raise RequestError(f"invalid request: {exc}", param=param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse a chat-completions body, or raise RequestError naming the bad field."""
    return decode_with(_request_decoder, body)


def decode_reload_request(body: bytes) -> ReloadRequest:
    """Parse a /reload body, or raise RequestError naming the bad field."""
    return decode_with(_reload_decoder, body)


def _text_of(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        if part.type != "text" or isinstance(part.text, UnsetType):
            raise RequestError(
                f"content part type {part.type!r} is not supported; only text parts are", param=f"{param}[{i}]"
            )
        texts.append(part.text)
    return "".join(texts)


def _arguments_for_template(arguments: str | dict[str, Any]) -> Any:
    """Arguments as a mapping when they are a JSON object (as vLLM passes them to templates), else as given."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as plain dicts for the chat template (content flattened to text)."""
    if not request.messages:
        raise RequestError("messages must contain at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise RequestError(
                f"message role {message.role!r} is not one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        item: dict[str, Any] = {"role": message.role, "content": _text_of(message.content, f"messages[{i}].content")}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": "" if isinstance(call.id, UnsetType) else call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_for_template(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        for key in ("name", "tool_call_id"):
            value = getattr(message, key)
            if not isinstance(value, UnsetType):
                item[key] = value
        out.append(item)
    return out


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The offered tools as plain dicts for the chat template (None when there are none)."""
    if not request.tools:
        return None
    for i, tool in enumerate(request.tools):
        if tool.get("type", "function") != "function":
            raise RequestError(
                f"tool type {tool.get('type')!r} is not supported; use 'function'", param=f"tools[{i}].type"
            )
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError("each tool needs a function object with a name", param=f"tools[{i}].function")
    return request.tools


def parses_tools(request: ChatCompletionRequest) -> bool:
    """Whether to look for tool calls in the output: tools offered and tool_choice not 'none'."""
    choice = request.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        raise RequestError(
            "tool_choice must be 'auto' or 'none' for this engine (forced tool calls need guided decoding)",
            param="tool_choice",
            code="unsupported_value",
        )
    return bool(request.tools) and choice != "none"


def _check(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise RequestError(message, param=param)


def sampling_params(
    request: ChatCompletionRequest, prompt_len: int, max_model_len: int, vocab_size: int
) -> SamplingParams:
    """Validated sampling parameters; max_tokens defaults to what the context leaves."""
    if request.response_format is not None and request.response_format.get("type", "text") != "text":
        raise RequestError(
            "response_format other than 'text' is not supported by this engine",
            param="response_format",
            code="unsupported_value",
        )
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
    temperature = 1.0 if request.temperature is None else request.temperature
    _check(temperature >= 0.0, f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = 1.0 if request.top_p is None else request.top_p
    _check(0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = request.top_k if request.top_k not in (None, -1) else 0
    _check(top_k >= 0, f"top_k must be -1, 0 (off) or a positive integer, got {top_k}", "top_k")
    n = 1 if request.n is None else request.n
    _check(1 <= n <= MAX_N, f"n must be between 1 and {MAX_N}, got {n}", "n")
    top_logprobs = request.top_logprobs or 0
    _check(0 <= top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    _check(top_logprobs == 0 or bool(request.logprobs), "top_logprobs requires logprobs to be true", "top_logprobs")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    _check(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    _check(all(stop), "stop strings must not be empty", "stop")
    stop_ids = frozenset(request.stop_token_ids or ())
    _check(all(0 <= t < vocab_size for t in stop_ids), f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    if prompt_len >= max_model_len:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has {prompt_len} tokens; "
            "shorten the conversation",
            param="messages",
            code="context_length_exceeded",
        )
    requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    if requested is not None:
        _check(requested >= 1, f"{param} must be at least 1, got {requested}", param)
        if prompt_len + requested > max_model_len:
            raise RequestError(
                f"this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} and "
                f"{param} asks for {requested} more; lower {param}",
                param=param,
                code="context_length_exceeded",
            )
    return SamplingParams(
        max_tokens=requested if requested is not None else max_model_len - prompt_len,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        top_logprobs=top_logprobs,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=bool(request.ignore_eos),
    )


# ---- responses ------------------------------------------------------------------------------------


class Usage(msgspec.Struct):
    """Token counts of one request (completion tokens summed over choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChoiceLogprobs(msgspec.Struct):
    """Per-choice logprobs: one entry per generated token, aligned with token_ids."""

    content: list[LogprobEntry]


class AssistantMessage(msgspec.Struct):
    """The generated message."""

    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET


class Choice(msgspec.Struct):
    """One choice of a non-streaming response."""

    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str
    stop_reason: str | int | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletion(msgspec.Struct):
    """A non-streaming response (vLLM's shape)."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    weights_version: int
    object: str = "chat.completion"
    prompt_token_ids: list[int] | UnsetType = UNSET


class FunctionDelta(msgspec.Struct):
    """A tool call's function in a stream delta (sent whole, in one chunk)."""

    name: str
    arguments: str


class ToolCallDelta(msgspec.Struct):
    """A tool call in a stream delta."""

    index: int
    id: str
    function: FunctionDelta
    type: str = "function"


class Delta(msgspec.Struct):
    """What a chunk adds to a choice's message."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChunkChoice(msgspec.Struct):
    """One choice's part of a stream chunk."""

    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | UnsetType | None = UNSET
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(msgspec.Struct):
    """A stream chunk (vLLM's shape): the first carries prompt_token_ids, the last usage when asked."""

    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    weights_version: int | UnsetType = UNSET


class ModelCard(msgspec.Struct):
    """An entry of GET /v1/models, with the weights version currently served."""

    id: str
    created: int
    root: str
    max_model_len: int
    weights_version: int
    object: str = "model"
    owned_by: str = "rollwire"
    parent: str | None = None


class ModelList(msgspec.Struct):
    """GET /v1/models."""

    data: list[ModelCard]
    object: str = "list"
