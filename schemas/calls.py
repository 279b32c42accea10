"""Reading recorded calls: struct types made from `ModelRequestRecorded`'s own field list.

A reader that needs only some of a `model_request`'s fields (the trainer skips the request and
response bodies; the projector keeps the bulky ones as raw JSON) decodes the same bytes into a
narrower struct. Those structs are derived here from the contract's fields (names, types,
defaults), never written out again: a new `ModelRequestRecorded` field reaches every reader that
keeps it with no other edit.

    CallRecord          the fields the trainer's adapter reads (bodies skipped, arrays left packed)
    derive(name, ...)   any other such view (the projector's `WireCall` and reference reader)

References to earlier calls are resolved by `schemas.refs.Resolver` (lists) and
`schemas.refs.ArrayResolver` (numpy arrays).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, TypeAlias, Union

import msgspec
from msgspec import NODEFAULT, UNSET, UnsetType

from schemas.codec import MalformedEvent
from schemas.events import ModelRequestRecorded

BODIES = ("request", "response", "usage", "api", "continuity", "schema_version")
"""What the adapter never reads: the conversation's text, and how it was asked for."""


def derive(
    name: str,
    *,
    keep: Collection[str] | None = None,
    drop: Collection[str] = (),
    unset: bool = False,
    bases: tuple[type[msgspec.Struct], ...] = (),
    **options: Any,
) -> type[msgspec.Struct]:
    """A struct with `ModelRequestRecorded`'s fields (those in `keep`, less `drop`), same types and defaults.

    With `unset`, each optional field defaults to `UNSET` instead, so a reader can tell a field the
    event omitted (its contract default applies) from one it set. `options` go to `msgspec.defstruct`
    (`kw_only` is always set: required fields may follow optional ones).
    """
    fields: list[tuple[str, Any, Any] | tuple[str, Any]] = []
    for field in msgspec.structs.fields(ModelRequestRecorded):
        if field.name in drop or (keep is not None and field.name not in keep):
            continue
        if field.required:
            fields.append((field.name, field.type))
        elif unset:
            fields.append((field.name, Union[field.type, UnsetType], UNSET))  # noqa: UP007
        elif field.default is NODEFAULT:
            fields.append((field.name, field.type, msgspec.field(default_factory=field.default_factory)))
        else:
            fields.append((field.name, field.type, field.default))
    return msgspec.defstruct(name, fields, bases=bases or None, kw_only=True, module=__name__, **options)


if TYPE_CHECKING:
    # The type checker sees the event itself: a CallRecord has a subset of its fields, same types.
    CallRecord: TypeAlias = ModelRequestRecorded
else:
    CallRecord = derive("CallRecord", drop=BODIES, frozen=True, gc=False)
    CallRecord.__doc__ = "A `model_request` event with only the fields the adapter reads (bodies skipped)."

CallEvent: TypeAlias = ModelRequestRecorded | CallRecord
"""A recorded model call, whole or with the adapter's fields only."""

_call_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(CallRecord)


def decode_call(data: bytes) -> CallRecord:
    """A `model_request` event's bytes as a `CallRecord`: request and response bodies skipped, arrays left packed.

    What a reader that feeds the adapter decodes calls into (the trainer, the replay): the adapter
    reads packed arrays straight into numpy arrays and resolves references itself, in order.
    Raises `MalformedEvent` for bytes that are not such an event.
    """
    try:
        record: CallRecord = _call_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedEvent(str(exc)) from None
    return record
