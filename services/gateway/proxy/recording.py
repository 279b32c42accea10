"""Building the compact `model_request` events: references to an earlier call, packed arrays.

The proxy hands every call's events (one per choice, full prompt and request) to `CallChains`
before appending them. For each attempt it remembers the last few `ok` calls it recorded (their
full prompt + response ids, their request, their stream sequence), and a new call whose prompt
shares at least `MIN_SHARED` leading tokens with one of them is recorded as a reference to the
one it shares most with, plus only the ids after that prefix; the request copy keeps only the keys
that changed and, for a list such as `messages`, only the items after the shared ones (see
`schemas/refs.py` for the wire form). Every event's arrays are packed (base64 int32 / float32).

The memory is a cache bounded by bytes: an evicted or never-seen call (another gateway replica
recorded it, this process restarted) just means the next call is recorded in full, so nothing
depends on it for correctness. A reference points only at a call JetStream acknowledged, of the
same rollout attempt, hence earlier on the same subject.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from schemas import CallRef, ModelRequestRecorded
from schemas.refs import IdArray, pack
from services.common.bytecache import ByteLRU
from services.common.eventstore import Appended
from services.gateway.proxy.payload import cut_request
from services.gateway.proxy.promptids import AttemptKey, PromptIds

MIN_SHARED = 16
"""Fewest shared leading tokens worth a reference (below it the call is recorded in full)."""
PER_ATTEMPT = 8
"""Recent `ok` calls remembered per attempt (harnesses with sub-agents interleave a few chains)."""

IN_FLIGHT_PROMPT_BYTES = 256 << 20
"""Memory for the prompt arrays of the calls between compaction and their ack (a call whose array was
pushed out is not kept for later references, which only costs those a full record)."""

_encode = msgspec.json.Encoder().encode


class RecordedCall(msgspec.Struct, frozen=True, gc=False):
    """An acknowledged `ok` call of an attempt: its full prompt + response ids, request and answer."""

    event_id: str
    seq: int
    tokens: Any  # numpy int32 array: the full prompt + response ids
    request: dict[str, Any]
    size: int
    prompt_len: int = 0
    reply: dict[str, Any] | None = None
    """The assistant message the harness was given back (continuous prompt mode matches on it)."""


def _shared(prompt: Any, tokens: Any) -> int:
    """How many leading ids two int32 arrays share."""
    n = min(len(prompt), len(tokens))
    if n == 0:
        return 0
    differ = prompt[:n] != tokens[:n]
    first = int(differ.argmax())  # the first True; 0 also when none differ
    return first if differ[first] else n


def _ids(values: PromptIds) -> IdArray | None:
    try:
        return np.asarray(values, dtype=np.int32) if len(values) else None
    except OverflowError:
        return None


def compact_request(
    request: dict[str, Any], earlier: dict[str, Any]
) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    """What a request adds to an earlier one: the changed keys, the new items of lists that extend.

    Returns (the request to store, keys kept unchanged, list keys with how many items are shared).
    """
    stored: dict[str, Any] = {}
    same: list[str] = []
    prefix: dict[str, int] = {}
    for key, value in request.items():
        old = earlier.get(key, _MISSING)
        if old is _MISSING:
            stored[key] = value
        elif old == value:
            same.append(key)
        elif isinstance(value, list) and isinstance(old, list):
            n = 0
            for a, b in zip(value, old, strict=False):
                if a != b:
                    break
                n += 1
            if n:
                prefix[key] = n
                stored[key] = value[n:]
            else:
                stored[key] = value
        else:
            stored[key] = value
    return stored, same, prefix


_MISSING = object()


class CallChains:
    """The recent `ok` calls of each attempt, for recording new calls as references (bounded by bytes)."""

    def __init__(self, max_bytes: int = 256 << 20, *, compact: bool = True) -> None:
        self.references = compact
        self.attempts: ByteLRU[AttemptKey, list[RecordedCall]] = ByteLRU(max_bytes, _calls_size)
        self.referenced = 0
        self._prompts: ByteLRU[str, IdArray] = ByteLRU(IN_FLIGHT_PROMPT_BYTES, _nbytes)
        """The prompt arrays `compact` made or was given, by the call's first event id, for `remember`
        (every call's append ends in `remember` or `drop`; the bound only covers one that does not)."""

    def compact(
        self, events: list[ModelRequestRecorded], prompt_ids: PromptIds | None = None
    ) -> list[ModelRequestRecorded]:
        """The events as recorded: a reference and the new ids where an earlier call is shared, arrays packed.

        `prompt_ids`, when given, are the call's prompt ids (its events' own `prompt_ids` are then
        left empty: an array parsed from the engine's answer never becomes a list unless the
        version-1 encoding needs it)."""
        if not events:
            return events
        first = events[0]
        given = first.prompt_ids if prompt_ids is None else prompt_ids
        if not self.references:  # the version-1 encoding of calls: full JSON lists, no reference
            if given is not first.prompt_ids:
                listed = given.tolist() if isinstance(given, np.ndarray) else list(given)
                events = [msgspec.structs.replace(event, prompt_ids=listed) for event in events]
            _check_ids(events)
            return events
        base: RecordedCall | None = None
        shared = 0
        prompt = _ids(given)
        if prompt is not None and first.status == "ok":
            self._prompts.put(first.event_id, prompt)
            for recorded in reversed(self.attempts.get(_key(first)) or []):
                n = _shared(prompt, recorded.tokens)
                if n > shared:
                    base, shared = recorded, n
                if shared == len(prompt):  # no earlier call can share more than the whole prompt
                    break
        if base is None or shared < MIN_SHARED:
            return [_packed(event, given, event.request, UNSET) for event in events]
        self.referenced += 1
        request, same, prefix = compact_request(first.request, base.request)
        ref = CallRef(event_id=base.event_id, seq=base.seq, tokens=shared, same=same, prefix=prefix)
        rest = given[shared:]
        return [_packed(event, rest, request, ref) for event in events]

    def remember(self, events: list[ModelRequestRecorded], appended: Sequence[Appended]) -> None:
        """Keep the acknowledged `ok` calls (full events, as built before `compact`) for later references
        and continuous prompts."""
        made = self._prompts.pop(events[0].event_id) if events else None
        for event, ack in zip(events, appended, strict=True):
            if event.status != "ok" or ack.duplicate:
                continue
            prompt = made if made is not None else _ids(event.prompt_ids)
            if prompt is None:  # no prompt ids, or one outside int32: nothing to reference
                continue
            response = _ids(event.response_ids) if event.response_ids else None
            if event.response_ids and response is None:  # an id outside int32: not kept
                continue
            tokens = prompt if response is None else np.concatenate((prompt, response))
            self.add(_key(event), event, ack.seq, tokens, len(prompt))

    def drop(self, events: list[ModelRequestRecorded]) -> None:
        """Forget what `compact` made for events whose append failed (they are not remembered)."""
        if events:
            self._prompts.pop(events[0].event_id)

    def add(self, key: AttemptKey, event: ModelRequestRecorded, seq: int, tokens: Any, prompt_size: int) -> None:
        """Keep one call (full prompt + response ids, `prompt_size` of them the prompt's, and its request)
        of an attempt, the oldest of more than PER_ATTEMPT dropped."""
        reply = event.response.get("message") if isinstance(event.response, dict) else None
        size = tokens.nbytes + len(_encode(event.request)) + (len(_encode(reply)) if reply else 0)
        calls = self.attempts.pop(key) or []
        calls.append(
            RecordedCall(
                event.event_id,
                seq,
                tokens,
                event.request,
                size,
                prompt_size,
                reply if isinstance(reply, dict) else None,
            )
        )
        self.attempts.put(key, calls[-PER_ATTEMPT:])  # an attempt larger than the budget is not kept

    def recent(self, key: AttemptKey) -> list[RecordedCall] | None:
        """The attempt's remembered calls, oldest first (None: nothing is cached for it)."""
        return self.attempts.get(key)

    def new_request_bytes(self, key: AttemptKey, request: dict[str, Any]) -> int:
        """Bytes of the request copy a call would record: what the attempt's latest calls do not hold."""
        best = len(_encode(request))
        for recorded in (self.attempts.get(key) or [])[-2:] if self.references else []:
            stored, _same, _prefix = compact_request(request, recorded.request)
            best = min(best, len(_encode(stored)))
        return best

    def forget(self, run_id: str, rollout_id: str, attempt_id: str | None) -> None:
        """Drop an attempt's calls (it ended: nothing will reference them)."""
        self.attempts.pop((run_id, rollout_id, attempt_id))


def _nbytes(prompt: IdArray) -> int:
    return int(prompt.nbytes)


def _calls_size(calls: list[RecordedCall]) -> int:
    return sum([r.size for r in calls])  # a list: a generator costs a frame resumed per call


def _key(event: ModelRequestRecorded) -> AttemptKey:
    return (event.run_id, event.rollout_id, event.attempt_id)


def _packed(
    event: ModelRequestRecorded, prompt: PromptIds, request: dict[str, Any], ref: CallRef | UnsetType | None
) -> ModelRequestRecorded:
    if not (len(prompt) or event.response_ids or event.logprobs):
        return msgspec.structs.replace(event, prompt_ids=[], request=request, prompt_ref=ref)
    try:
        packed = pack(prompt, event.response_ids, event.logprobs)
    except OverflowError:  # an id outside int32, which no reader accepts
        raise OutOfBounds("a token id is outside 0..2^31-1") from None
    if packed.id_width == 4:  # some id is negative or past 24 bits (3 bytes each otherwise): which?
        listed = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
        _check_ids([msgspec.structs.replace(event, prompt_ids=listed)])
    return msgspec.structs.replace(
        event, prompt_ids=[], response_ids=[], logprobs=[], request=request, prompt_ref=ref, packed=packed
    )


def cut(event: ModelRequestRecorded, reason: str) -> ModelRequestRecorded:
    """A failed call's event without the bulk that made it too large to store (its request copy, its ids)."""
    return msgspec.structs.replace(
        event,
        request=cut_request(event.request, reason),
        response={},
        prompt_ids=[],
        response_ids=[],
        logprobs=[],
    )


class OutOfBounds(Exception):
    """The engine answered what the contract cannot hold (a token id of 2^32 or -1, a usage count of
    2^63, a weights version of 3e9): the call was recorded as failed without it; the client gets 502."""

    prefix = "the model endpoint's answer is outside the bounds of a recorded call"

    def __init__(self, why: str) -> None:
        super().__init__(f"{self.prefix}: {why}")
        self.why = why


_FIELD_TYPES = {f.name: f.type for f in msgspec.structs.fields(ModelRequestRecorded)}
"""A call's fields with the contract's own types (and bounds: `schemas.bounds.Count`, `Int32`)."""
_SCALARS = ("choice_index", "weights_version", "usage", "top_k", "latency_s")
_Scalars = msgspec.defstruct("_Scalars", [(name, _FIELD_TYPES[name]) for name in _SCALARS])
"""The bounded scalar fields of a call, checked in one conversion."""
_IDS = ("prompt_ids", "response_ids")


def out_of_bounds(events: Sequence[ModelRequestRecorded]) -> str | None:
    """Why an event would be refused by `schemas.decode` (a value outside its field's bounds), or None.

    The check uses the schema's own types, so the writer refuses exactly what every reader refuses
    (msgspec does not check constraints on construction). Token ids are checked where they are
    packed (`_packed`: an id outside int32 cannot be packed, and a negative one widens the packing
    to 4 bytes, the rare case checked in full), so a long prompt costs no extra pass."""
    for event in events:
        try:
            msgspec.convert({name: getattr(event, name) for name in _SCALARS}, _Scalars)
        except msgspec.ValidationError as exc:  # "... - at `$.weights_version`": the path names the field
            return str(exc)
    return None


def _check_ids(events: Sequence[ModelRequestRecorded]) -> None:
    """Raise OutOfBounds when a token id is outside the contract's type for it (every element checked)."""
    for event in events:
        for name in _IDS:
            try:
                msgspec.convert(getattr(event, name), _FIELD_TYPES[name])
            except msgspec.ValidationError as exc:
                raise OutOfBounds(f"{name}: {exc}") from None


def not_recorded(exc: Exception) -> str:
    """The 503 message for a call whose record failed: what happened to the record, and to retry."""
    return f"this call's answer was not delivered because it could not be recorded ({exc}); retry it"
