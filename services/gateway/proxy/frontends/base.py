"""What a front end provides to the recording pipeline, and each API's error shape.

A front end turns its API's request into the engine's chat-completions body (through the
canonical `Conversation`, or as-is for Chat Completions) and gives the pipeline a `Translator`
that writes the engine's answer back in its API's format: a whole response, or a stream whose
closing part is held until the call is recorded. Errors use the API's own shape, so each SDK's
exception carries the reason: OpenAI's `{"error": {"message", "type", "code"}}` and Anthropic's
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import msgspec

from services.gateway.proxy.openai_format import ChoiceRecord, StreamFold

Api = Literal["openai", "anthropic"]
_encode = msgspec.json.Encoder().encode

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(api: Api, status: int, message: str, kind: str | None = None, **extra: Any) -> bytes:
    """An error response body in the API's own shape; `extra` fields ride inside the error object."""
    if api == "anthropic":
        error = {"type": kind or _ANTHROPIC_TYPES.get(status, "api_error"), "message": message, **extra}
        return _encode({"type": "error", "error": error})
    return _encode(
        {
            "error": {
                "message": message,
                "type": kind or _OPENAI_TYPES.get(status, "upstream_error"),
                "code": status,
                **extra,
            }
        }
    )


CONTEXT_ADVICE = (
    " The model endpoint's context window is smaller than this call (Claude Code's first prompt alone is"
    " about 37k tokens, and it asks for up to 64000 output tokens; the default stack's tiny model has 16384"
    " positions). Serve a model with a longer"
    " context: the engine's `--max-model-len` setting (`vllm serve --max-model-len`, `[engine] extra_args`,"
    " at most the model's max_position_embeddings),"
    " or send a shorter prompt or a smaller max_tokens (Claude Code: CLAUDE_CODE_MAX_OUTPUT_TOKENS)."
    " Retrying the same call cannot succeed."
)
"""Added to an engine's context-length refusal, which its own words do not say how to fix."""
# vLLM says "maximum context length" for a prompt too long, and "max_tokens=N cannot be greater than
# max_model_len=M" for a max_tokens beyond it (vllm/renderers/params.py, v0.32.0); OpenAI says its code.
_CONTEXT_MARKERS = ("context_length_exceeded", "maximum context length", "cannot be greater than max_model_len")


def upstream_message(content: bytes, status: int) -> str:
    """The message of an engine's error body (OpenAI-shaped or not); a context-length refusal (the
    prompt does not fit the engine's context, refused before generation) says what to change."""
    try:
        body = msgspec.json.decode(content)
    except msgspec.DecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = str(body["error"].get("message") or body["error"])
    elif isinstance(body, dict) and isinstance(body.get("error"), str):
        message = body["error"]
    else:
        message = content.decode(errors="replace")[:2000] or f"the model endpoint answered {status}"
    if status == 400 and any(marker in content[:4000].decode(errors="replace").lower() for marker in _CONTEXT_MARKERS):
        message += CONTEXT_ADVICE
    return message


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One named server-sent event."""
    return b"event: " + event.encode() + b"\ndata: " + _encode(data) + b"\n\n"


class Translator(Protocol):
    """Writes the engine's answer in one API's format (see the module docstring)."""

    api: Api

    def complete(self, answer: dict[str, Any], content: bytes | None, records: list[ChoiceRecord]) -> bytes:
        """The body of a non-streamed 200 answer (`content`: the engine's own bytes when they are that answer
        as it sent it, None when the proxy rewrote it)."""
        ...

    def begin(self) -> bytes:
        """Bytes that open a stream (sent before the engine's first chunk; may be empty)."""
        ...

    def chunk(self, chunk: dict[str, Any], data: bytes) -> tuple[bytes, bytes]:
        """One engine chunk (already folded): (bytes to send now, bytes to hold until recorded)."""
        ...

    def end(self, fold: StreamFold) -> bytes:
        """The bytes that close a stream, sent after the call is recorded."""
        ...

    def upstream_error(self, status: int, content: bytes) -> bytes:
        """The body passed on for an engine's error answer."""
        ...

    def stream_error(self, status: int, message: str) -> bytes:
        """An error event that ends a stream."""
        ...
