"""Turning stream messages into what the fold needs, before any transaction is open.

Decoding, packing token ids, decoding text with a tokenizer and matching the flag rules are the
CPU-heavy part of projecting; doing them here, while the previous batch is being written, keeps
the Postgres transaction short. A message that cannot be decoded or packed becomes an `Incoming`
with `error` set: the fold turns it into a dead letter.

Model calls, nearly all of the stream's bytes, are decoded with their bulky fields left as raw
JSON (`WireCall`): the id lists are packed straight from their text and the request and response
go to `jsonb` as they are, without a round trip through Python objects. The fold then sees a
`ModelRequestRecorded` with those fields empty; their values are in `Incoming.call`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import msgspec
from msgspec import UNSET, Raw
from nats.aio.msg import Msg

from schemas import (
    EVENT_TYPES,
    AnyEvent,
    InvalidId,
    MalformedEvent,
    ModelRegistered,
    ModelRequestRecorded,
    from_dict,
    to_dict,
)
from schemas.calls import derive
from schemas.refs import CallRef, PackedTokens, check_packed, floats_float64, ids_int32
from services.projector.flags import call_flags
from services.projector.packing import PromptCache, pack_float64_json, pack_int32_json, unpack_int32
from services.projector.refs import Known, RefCache, RefError
from services.projector.tokens import Detokenizer

_json = msgspec.json.Encoder()
# Types whose JSON body lives in a table of their own (model_calls, rewards, custom_events).
TYPED_BODIES = frozenset({"model_request", "reward", "custom"})
# ModelRequestRecorded's fields that WireCall keeps as raw JSON.
RAW_FIELDS = ("prompt_ids", "response_ids", "logprobs", "request", "response", "prompt_ref", "packed")


if TYPE_CHECKING:
    _WireFields = msgspec.Struct
else:  # every other field of the contract's, UNSET when the event omits it
    _WireFields = derive("_WireFields", drop=RAW_FIELDS, unset=True)


class WireCall(_WireFields, kw_only=True, tag_field="type", tag="model_request"):
    """A `ModelRequestRecorded` as decoded by the projector: the same fields, bulky ones raw.

    The fields other than `RAW_FIELDS` are the contract's own (`schemas.calls.derive`), UNSET when
    the event omits them: `envelope` gives them `ModelRequestRecorded`'s defaults.
    """

    prompt_ids: Raw = Raw(b"[]")
    response_ids: Raw = Raw(b"[]")
    logprobs: Raw = Raw(b"[]")
    request: Raw = Raw(b"{}")
    response: Raw = Raw(b"{}")
    prompt_ref: CallRef | None = None
    packed: PackedTokens | None = None

    def envelope(self) -> ModelRequestRecorded:
        """The event without its raw fields (validates ids exactly as `schemas.decode` does)."""
        fields = {
            name: value
            for name in self.__struct_fields__
            if name not in RAW_FIELDS and (value := getattr(self, name)) is not UNSET
        }
        return ModelRequestRecorded(**fields)


_WIRE_TYPES: tuple[Any, ...] = (*tuple(t for t in EVENT_TYPES if t is not ModelRequestRecorded), WireCall)
_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(Union[_WIRE_TYPES])  # noqa: UP007


class RequestRef(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """How a stored request copy continues the referenced call's (`CallRef`'s `same` and `prefix`)."""

    same: list[str] = []
    prefix: dict[str, int] = {}


class PreparedCall(msgspec.Struct):
    """A model call's column values that do not depend on the rest of the stream.

    `prompt_ids` and `prompt_text` are the call's full prompt (the sample count and the flags
    read them); when `base_seq` is set the row stores only what follows the first `base_tokens`
    ids and `base_text` characters of that earlier row's prompt + response (see `fold.CallRow`).
    """

    prompt_ids: bytes
    response_ids: bytes
    logprobs: bytes
    prompt_tokens: int
    response_tokens: int
    prompt_text: str | None
    response_text: str | None
    response_pieces: list[str] | None
    request: str
    response: str
    usage: str
    flags: list[str]
    base_seq: int | None = None
    base_tokens: int = 0
    base_text: int = 0
    request_ref: str | None = None


class Incoming(msgspec.Struct):
    """One stream message, decoded: its event (or why it has none) and its precomputed rows."""

    seq: int
    subject: str
    data: bytes
    stream_time: float
    event: AnyEvent | None = None
    error: str | None = None
    body: str | None = None
    call: PreparedCall | None = None


def event_type(event: Any) -> str:
    """The event's `type` tag (msgspec keeps tags on the class, not on instances)."""
    return str(type(event).__struct_config__.tag)


_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def nul_escaped_json(text: str) -> str:
    """JSON text Postgres can store: each NUL character (`\\u0000`) becomes the visible text `\\u0000`.

    Postgres refuses NUL in `text` and `jsonb`; a model may well produce one, and dead-lettering
    the call would hide it from the API and the viewer. The ids keep the exact tokens.
    """
    return _NUL_ESCAPE.sub(r"\1\\\\u0000", text) if "\\u0000" in text else text


def nul_escaped_text(text: str | None) -> str | None:
    """Text Postgres can store: a NUL character becomes the visible text `\\u0000`."""
    return text.replace("\x00", "\\u0000") if text is not None and "\x00" in text else text


def _json_object(raw: Raw, field: str) -> str:
    text = bytes(raw)  # a raw JSON value has no surrounding whitespace
    if text[:1] != b"{":
        raise msgspec.ValidationError(f"Expected `object` - at `$.{field}`")
    return nul_escaped_json(text.decode())


def _response_dict(raw: str) -> dict[str, Any]:
    # Only replies that carry tool calls or code blocks can match a rule: skip parsing the rest.
    if "tool_calls" not in raw and "```" not in raw:
        return {}
    value = msgspec.json.decode(raw)
    return value if isinstance(value, dict) else {}


def _arrays(
    wire: WireCall, event: ModelRequestRecorded, cache: PromptCache | None, refs: RefCache | None, seq: int
) -> tuple[bytes, bytes, bytes]:
    """The call's full prompt ids, response ids (int32) and logprobs (float64), packed."""
    packed = wire.packed
    if packed is not None:
        check_packed(packed)  # widths and lengths: a bad one is refused, not stored as other ids
        prompt = ids_int32(packed.prompt, packed.id_width)
        response = ids_int32(packed.response, packed.id_width)
        logprobs = floats_float64(packed.logprobs, packed.logprob_width)
    else:
        prompt_text = bytes(wire.prompt_ids)
        if cache is not None and wire.prompt_ref is None:
            prompt = cache.pack((event.run_id, event.rollout_id, event.attempt_id), prompt_text)
        else:
            prompt = pack_int32_json(prompt_text)
        response = pack_int32_json(bytes(wire.response_ids))
        logprobs = pack_float64_json(bytes(wire.logprobs))
    if wire.prompt_ref is not None:
        if refs is None:
            raise RefError("a call with a prompt reference needs the projector's reference cache")
        prompt = refs.prompt(wire.prompt_ref, prompt)
    if refs is not None:  # kept even if the rest of the event cannot be stored: later calls still resolve
        refs.keep(event.event_id, event.status, Known(seq, (event.run_id, event.rollout_id), prompt + response, None))
    return prompt, response, logprobs


def shared_prefix(text: str, base: str) -> int:
    """How many leading characters `text` and `base` share."""
    if text.startswith(base):
        return len(base)
    low, high = 0, min(len(text), len(base))
    while low < high:  # the longest equal prefix, by halving (each test a C-level compare)
        middle = (low + high + 1) // 2
        if text[:middle] == base[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _reference(row: PreparedCall, wire: WireCall, seq: int, event: ModelRequestRecorded, refs: RefCache | None) -> None:
    """Point the row at the referenced call's row when that row is of the same rollout; keep this call's text."""
    ref = wire.prompt_ref
    rollout = (event.run_id, event.rollout_id)
    if ref is not None and refs is not None:
        base = refs.base(ref)
        if base.rollout == rollout and base.seq < seq:
            row.base_seq, row.base_tokens = base.seq, len(base.sequence[: 4 * ref.tokens]) // 4
            if row.prompt_text is not None and base.text is not None:
                row.base_text = shared_prefix(row.prompt_text, base.text)
            row.request_ref = _json.encode(RequestRef(same=ref.same, prefix=ref.prefix)).decode()
    if refs is not None and row.prompt_text is not None:
        text = row.prompt_text + (row.response_text or "")
        refs.keep(event.event_id, event.status, Known(seq, rollout, row.prompt_ids + row.response_ids, text))


def _call_row(
    wire: WireCall,
    event: ModelRequestRecorded,
    detok: Detokenizer | None,
    cache: PromptCache | None,
    refs: RefCache | None = None,
    seq: int = 0,
) -> PreparedCall:
    prompt, response, logprobs = _arrays(wire, event, cache, refs, seq)
    response_json = _json_object(wire.response, "response")
    decoded = detok.decode(event.model, unpack_int32(prompt), unpack_int32(response)) if detok else None
    row = PreparedCall(
        prompt_ids=prompt,
        response_ids=response,
        logprobs=logprobs,
        prompt_tokens=len(prompt) // 4 or int(event.usage.get("prompt_tokens", 0)),
        response_tokens=len(response) // 4 or int(event.usage.get("completion_tokens", 0)),
        prompt_text=nul_escaped_text(decoded.prompt_text) if decoded else None,
        response_text=nul_escaped_text(decoded.response_text) if decoded else None,
        response_pieces=[nul_escaped_text(p) or "" for p in decoded.response_pieces] if decoded else None,
        request=_json_object(wire.request, "request"),
        response=response_json,
        usage=_json.encode(event.usage).decode(),
        flags=call_flags(_response_dict(response_json), event.finish_reason, event.status, event.error),
    )
    _reference(row, wire, seq, event, refs)
    return row


def _body(event: AnyEvent, data: bytes) -> str | None:
    """The event's JSON for `events.body`: as on the stream (fields at their default absent, since
    version 4; readers fill them, `full_body`), a model registration without its API key."""
    if event_type(event) in TYPED_BODIES:
        return None
    if isinstance(event, ModelRegistered):
        body = to_dict(event)
        body.pop("api_key", None)  # secrets stay on the stream, never in the read models
        return _json.encode(body).decode()
    return data.decode()


def full_body(text: str | None) -> dict[str, Any]:
    """An `events.body` with every field, defaults filled (as `to_dict` gives them); {} for none."""
    if text is None:
        return {}
    try:
        return to_dict(from_dict(msgspec.json.decode(text)))
    except (MalformedEvent, msgspec.DecodeError):  # not an event this version knows: as stored
        body = msgspec.json.decode(text)
        return body if isinstance(body, dict) else {}


def prepare_one(
    seq: int,
    subject: str,
    data: bytes,
    stream_time: float,
    detok: Detokenizer | None,
    cache: PromptCache | None = None,
    refs: RefCache | None = None,
) -> Incoming:
    """Decode one message and precompute its rows; an undecodable one carries `error`."""
    try:
        decoded = _decoder.decode(data)
        event = decoded.envelope() if isinstance(decoded, WireCall) else decoded
        call = _call_row(decoded, event, detok, cache, refs, seq) if isinstance(decoded, WireCall) else None
        body = _body(event, data)
    except (msgspec.ValidationError, msgspec.DecodeError, InvalidId) as exc:
        return Incoming(seq, subject, data, stream_time, error=f"undecodable event: {exc}")
    except (OverflowError, UnicodeDecodeError, ValueError) as exc:
        return Incoming(seq, subject, data, stream_time, error=f"cannot store the event: {exc}")
    return Incoming(seq, subject, data, stream_time, event=event, body=body, call=call)


def position(msg: Msg) -> tuple[int, float]:
    """A JetStream message's stream sequence and stored time, read off its reply subject.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<cseq>.<ns>.<pending>`, or the longer form with a
    domain and account hash in front. `Msg.metadata` parses the same but builds objects and a
    datetime per message, which shows in the projector's profile.
    """
    tokens = (msg.reply or "").split(".")
    if tokens[0] == "$JS" and len(tokens) == 9:
        return int(tokens[5]), int(tokens[7]) / 1e9
    if tokens[0] == "$JS" and len(tokens) >= 11:
        return int(tokens[7]), int(tokens[9]) / 1e9
    meta = msg.metadata  # anything else: the client library decides (it raises if not JetStream)
    return meta.sequence.stream, meta.timestamp.timestamp()


def prepare(
    msgs: Sequence[Msg],
    detok: Detokenizer | None = None,
    cache: PromptCache | None = None,
    refs: RefCache | None = None,
) -> list[Incoming]:
    """`prepare_one` over fetched JetStream messages."""
    out: list[Incoming] = []
    for msg in msgs:
        seq, stored_at = position(msg)
        out.append(prepare_one(seq, msg.subject, msg.data, stored_at, detok, cache, refs))
    return out
