"""An engine's SSE stream relayed to the client as it arrives, each chunk folded for the record."""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.asgi import Send
from services.gateway.proxy.frontends.base import Translator
from services.gateway.proxy.openai_format import StreamFold
from services.gateway.proxy.tokenin import ChunkConverter
from services.gateway.proxy.upstream import UpstreamResponse

_decode_obj = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.Encoder().encode


async def relay_stream(
    response: UpstreamResponse,
    fold: StreamFold,
    held: list[bytes],
    translator: Translator,
    send: Send,
    convert: ChunkConverter | None,
) -> None:
    """Forward SSE events as they arrive, folding each; hold back what the translator holds."""
    buffer = b""
    async for raw in response.iter_chunks():
        buffer += raw
        if b"\r\n" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        if b"\n\n" not in buffer:
            continue
        *events, buffer = buffer.split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            data = b"".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if not data or data == b"[DONE]":
                continue
            try:
                chunk = _decode_obj(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if convert is not None and "choices" in chunk:
                chunk = convert.convert(chunk)
                data = _encode(chunk)
            fold.feed(chunk)
            if fold.model is None and isinstance(chunk.get("model"), str):
                fold.model = chunk["model"]
            now, later = translator.chunk(chunk, data)
            if now:
                out.append(now)
            if later:
                held.append(later)
        if out:
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
