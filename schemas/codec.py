"""JSON encoding of events: one encoder and one decoder, made once (see msgspec's guidance)."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from schemas.events import AnyEvent, Event, ModelRequestRecorded
from schemas.ids import InvalidId
from schemas.refs import check_packed, upcast_decoded

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[AnyEvent] = msgspec.json.Decoder(AnyEvent)


class MalformedEvent(ValueError):
    """Bytes or a mapping that is not a valid event; the message names the offending field."""


def encode(event: Event) -> bytes:
    """Encode an event as compact JSON bytes (the payload published on its subject).

    Fields at their default are left out (schema version 4); the envelope keys are always there.
    """
    return _encoder.encode(event)


def decode(data: bytes | str, *, unpack: bool = True) -> AnyEvent:
    """Decode JSON bytes into the typed event named by its `type` field.

    A call's `packed` arrays become plain lists (`schemas.refs.upcast`). With `unpack=False` they
    stay packed, as recorded, checked but not unpacked: a reader that looks at few calls' tokens
    (a monitor, a bulk reader that wants numpy arrays) skips making a Python int per token, most
    of a typed read's cost. Such a call's lists are empty; `schemas.refs.unpack_arrays` gives its
    arrays, `upcast` its lists, `Resolver.resolve` its full call, and the trainer takes it as is.
    """
    try:
        event = _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, InvalidId) as exc:
        raise MalformedEvent(str(exc)) from None
    if type(event) is ModelRequestRecorded and not (event.packed is UNSET and event.prompt_ref is UNSET):
        return _unpack(event, unpack)
    return event


def _unpack(event: ModelRequestRecorded, unpack: bool = True) -> ModelRequestRecorded:
    if event.prompt_ref is None or event.packed is None:  # explicit nulls (a table export): as if absent
        event = msgspec.structs.replace(
            event,
            prompt_ref=UNSET if event.prompt_ref is None else event.prompt_ref,
            packed=UNSET if event.packed is None else event.packed,
        )
    try:
        if unpack:
            return upcast_decoded(event)
        if event.packed:
            check_packed(event.packed)
        return event
    except (ValueError, TypeError) as exc:  # bad base64 or a length that is not whole values
        raise MalformedEvent(f"model_request {event.event_id}: packed arrays unreadable: {exc}") from None


def from_dict(obj: dict[str, Any]) -> AnyEvent:
    """Build a typed event from a plain mapping (for example a parsed HTTP body)."""
    try:
        event: AnyEvent = msgspec.convert(obj, AnyEvent)
    except (msgspec.ValidationError, InvalidId) as exc:
        raise MalformedEvent(str(exc)) from None
    if type(event) is ModelRequestRecorded and not (event.packed is UNSET and event.prompt_ref is UNSET):
        return _unpack(event)
    return event


def to_dict(event: Event) -> dict[str, Any]:
    """The event as a plain JSON-compatible mapping: its `type` tag and every field that is set.

    Unlike the encoded JSON (`encode`), fields at their default are included, so a reader of the
    mapping (an API answer, an export row) needs no knowledge of the defaults.
    """
    fields: dict[str, Any] = {"type": type(event).__struct_config__.tag}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if value is not UNSET:
            fields[name] = value
    return msgspec.to_builtins(fields)
