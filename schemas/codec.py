"""JSON encoding of events: one encoder and one decoder, made once (see msgspec's guidance)."""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.events import AnyEvent, Event
from schemas.ids import InvalidId

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[AnyEvent] = msgspec.json.Decoder(AnyEvent)  # type: ignore[arg-type]


class MalformedEvent(ValueError):
    """Bytes or a mapping that is not a valid event; the message names the offending field."""


def encode(event: Event) -> bytes:
    """Encode an event as compact JSON bytes (the payload published on its subject)."""
    return _encoder.encode(event)


def decode(data: bytes | str) -> AnyEvent:
    """Decode JSON bytes into the typed event named by its `type` field."""
    try:
        return _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, InvalidId) as exc:
        raise MalformedEvent(str(exc)) from None


def from_dict(obj: dict[str, Any]) -> AnyEvent:
    """Build a typed event from a plain mapping (for example a parsed HTTP body)."""
    try:
        return msgspec.convert(obj, AnyEvent)  # type: ignore[arg-type,no-any-return]
    except (msgspec.ValidationError, InvalidId) as exc:
        raise MalformedEvent(str(exc)) from None


def to_dict(event: Event) -> dict[str, Any]:
    """The event as a plain JSON-compatible mapping (with its `type` tag)."""
    return msgspec.to_builtins(event)  # type: ignore[no-any-return]
