"""Resolving version-2 call references on the projector's side, while a batch is prepared.

A `model_request` with `prompt_ref` stores only the ids after a prefix of an earlier call's
prompt + response (see `schemas/refs.py`). The projector keeps each `ok` call's full packed
sequence (int32 bytes) by event id, with where it was seen (stream sequence, run, rollout) and,
when a tokenizer decoded it, its prompt + response text, bounded by bytes. The full prompt feeds
the sample count and the decoded text; the row itself stores only the new part and points at the
referenced call's row (`calls.py` resolves it on read). Before a batch is prepared, `prime` makes
sure every referenced call is known: one the cache lost (the projector restarted mid-attempt, or
evicted it) is read back from the stream by its sequence (a direct get), recursively, so a
reference never depends on the cache.

Why this is not `schemas.refs.Resolver`: the rule is the same (the referenced prompt + response
cut at `prompt_ref.tokens`, then the new ids), but the projector keeps what it stores, packed int32
bytes and decoded text, across batches and runs, with each call's stream sequence and rollout (the
row a later row points at), and reads a lost call back from the stream; the contract's resolvers
hold one reader's calls in memory as lists or numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgspec
from nats.aio.msg import Msg

from schemas.calls import derive
from schemas.refs import CallRef, PackedTokens, ids_int32
from services.common.bytecache import ByteLRU
from services.common.eventstore import EventStore
from services.projector.packing import pack_int32_json

MAX_CHAIN = 100_000


class RefError(ValueError):
    """A referenced call cannot be found: the event's prompt cannot be resolved."""


if TYPE_CHECKING:
    _RefFields = msgspec.Struct
else:  # the contract's own fields (`schemas.calls.derive`)
    _RefFields = derive("_RefFields", keep=("run_id", "rollout_id", "event_id", "status"), gc=False)


class _Refs(_RefFields, kw_only=True, gc=False):
    """The fields of a `model_request` that resolving reads: the id arrays left as raw JSON."""

    prompt_ids: msgspec.Raw = msgspec.Raw(b"[]")
    response_ids: msgspec.Raw = msgspec.Raw(b"[]")
    prompt_ref: CallRef | None = None
    packed: PackedTokens | None = None
    if TYPE_CHECKING:
        run_id: str
        rollout_id: str | None
        event_id: str
        status: str


_decode_refs = msgspec.json.Decoder(_Refs).decode


class Known(NamedTuple):
    """An `ok` call as later calls reference it."""

    seq: int
    """The stream sequence it was read at: its `model_calls` row."""
    rollout: tuple[str, str | None]
    """Its run and rollout: a row only points at a row of its own rollout."""
    sequence: bytes
    """Its full prompt + response ids, packed int32."""
    text: str | None
    """Its stored prompt text + response text (None when not decoded)."""


def _size(known: Known) -> int:
    return len(known.sequence) + (len(known.text) if known.text else 0)


class RefCache:
    """What later calls reference of each `ok` call (`Known`), by event id."""

    def __init__(self, max_bytes: int = 128 << 20) -> None:
        self.entries: ByteLRU[str, Known] = ByteLRU(max_bytes, _size)
        self.fetched = 0

    def base(self, ref: CallRef) -> Known:
        """The referenced call (RefError when it is not known)."""
        base = self.entries.get(ref.event_id)
        if base is None:
            raise RefError(f"the referenced call {ref.event_id} (stream sequence {ref.seq}) is not known")
        return base

    def prompt(self, ref: CallRef | None, new: bytes) -> bytes:
        """The full packed prompt: the referenced call's first `ref.tokens` ids, then `new`."""
        if ref is None:
            return new
        return self.base(ref).sequence[: 4 * ref.tokens] + new

    def keep(self, event_id: str, status: str, known: Known) -> None:
        """Remember an `ok` call for the calls that reference it."""
        if status == "ok" and known.sequence:
            self.entries.put(event_id, known)

    def learn(self, data: bytes, seq: int) -> None:
        """Resolve and remember one call from its JSON bytes (RefError when its own reference is unknown)."""
        call = _decode_refs(data)
        packed = call.packed
        if packed is not None:
            new = ids_int32(packed.prompt, packed.id_width)
            response = ids_int32(packed.response, packed.id_width)
        else:
            new = pack_int32_json(bytes(call.prompt_ids))
            response = pack_int32_json(bytes(call.response_ids))
        full = self.prompt(call.prompt_ref, new) + response
        self.keep(call.event_id, call.status, Known(seq, (call.run_id, call.rollout_id), full, None))

    async def prime(self, store: EventStore, msgs: Sequence[Msg]) -> None:
        """Read back from the stream every call the batch references that is neither known nor in the batch."""
        in_batch: set[str] = set()
        for msg in msgs:
            if not msg.subject.endswith(".model_request"):
                continue
            try:
                call = _decode_refs(msg.data)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue  # prepare makes it a dead letter
            ref = call.prompt_ref
            if ref is not None and ref.event_id not in in_batch and ref.event_id not in self.entries:
                await self._fetch(store, ref)
            in_batch.add(call.event_id)

    async def _fetch(self, store: EventStore, ref: CallRef) -> None:
        """Read the referenced call and the unknown calls it references in turn, then learn them oldest first."""
        chain: list[tuple[bytes, int]] = []
        while ref.seq > 0 and ref.event_id not in self.entries and len(chain) < MAX_CHAIN:
            try:
                raw = await store.js.get_msg(store.stream, ref.seq)
            except Exception:
                break
            data = raw.data or b""
            try:
                call = _decode_refs(data)
            except (msgspec.ValidationError, msgspec.DecodeError):
                break  # not a call: the referencing call becomes a dead letter when prepared
            if call.event_id != ref.event_id:
                break
            chain.append((data, ref.seq))
            if call.prompt_ref is None:
                break
            ref = call.prompt_ref
        for data, seq in reversed(chain):
            self.fetched += 1
            try:
                self.learn(data, seq)
            except (RefError, ValueError):
                return
