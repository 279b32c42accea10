"""Chat Completions: the engine's own API, so the request is forwarded as the client wrote it.

The client's body is already the canonical conversation in the engine's wire form; the proxy
only sets `model`, asks for token ids and logprobs (`prepare_request`) and strips those extras
from the answer unless the client asked for them. What is recorded is the body as sent.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.proxy.frontends.base import Api, error_body, upstream_message
from services.gateway.proxy.openai_format import (
    ChoiceRecord,
    StreamFold,
    Wants,
    finishes,
    prepare_request,
    strip_chunk,
    strip_completion,
)

_encode = msgspec.json.Encoder().encode
_decode_any = msgspec.json.Decoder().decode


class ChatTranslator:
    """Passes the engine's chat answer through, minus the extras the client did not ask for."""

    api: Api = "openai"

    def __init__(self, wants: Wants) -> None:
        self.wants = wants
        self.passthrough = wants.token_ids and wants.logprobs and wants.usage_chunk

    def complete(self, answer: dict[str, Any], content: bytes | None, records: list[ChoiceRecord]) -> bytes:
        """The engine's answer, stripped."""
        if self.wants.token_ids and self.wants.logprobs:
            return content if content is not None else _encode(answer)
        strip_completion(answer, self.wants)
        return _encode(answer)

    def begin(self) -> bytes:
        """Nothing opens a chat stream but the engine's first chunk."""
        return b""

    def chunk(self, chunk: dict[str, Any], data: bytes) -> tuple[bytes, bytes]:
        """The chunk as an SSE line; the one finishing a choice (or the usage chunk) is held."""
        if not self.passthrough:
            if not strip_chunk(chunk, self.wants):
                return b"", b""
            data = _encode(chunk)
        line = b"data: " + data + b"\n\n"
        if finishes(chunk) or (not chunk.get("choices") and chunk.get("usage")):
            return b"", line
        return line, b""

    def end(self, fold: StreamFold) -> bytes:
        """The stream's terminator."""
        return b"data: [DONE]\n\n"

    def upstream_error(self, status: int, content: bytes) -> bytes:
        """The engine's error as it sent it when it is OpenAI-shaped, else wrapped."""
        try:
            body = _decode_any(content)
        except msgspec.DecodeError:
            body = None
        if isinstance(body, dict) and "error" in body:
            return content
        return error_body("openai", status, upstream_message(content, status))

    def stream_error(self, status: int, message: str) -> bytes:
        """An OpenAI error object as a data line."""
        return b"data: " + error_body("openai", status, message) + b"\n\n"


def prepare(request: dict[str, Any], upstream_model: str) -> tuple[bytes, ChatTranslator]:
    """The engine's body and the translator for a chat-completions request."""
    upstream_body, wants = prepare_request(request, upstream_model)
    return _encode(upstream_body), ChatTranslator(wants)
