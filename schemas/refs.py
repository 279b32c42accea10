"""Each token stored once: packed id arrays and references to an earlier call (schema version 2).

An agent's next prompt is usually its previous prompt plus the previous response plus an
observation. Recording every call's full prompt makes a rollout cost O(turns x context); so a
version-2 `model_request` whose prompt starts with an earlier call of the same attempt carries a
`prompt_ref` to that call and only the ids after the shared prefix:

    full prompt = (referenced call's full prompt + its response ids)[:prompt_ref.tokens] + prompt_ids

The request copy likewise keeps only what is new: keys listed in `prompt_ref.same` are the
referenced call's (resolved) values unchanged, and a key in `prompt_ref.prefix` (a list, such as
`messages`) is the referenced value's first n items followed by this event's items. References
only point at `ok` calls of the same rollout attempt, recorded earlier on the same subject;
`prompt_ref.seq` is the referenced message's stream sequence, so a monitor can fetch it directly
(JetStream's direct get by sequence), and `prompt_ref.event_id` is its event id.

Id and logprob arrays may be `packed`: base64 of little-endian unsigned 24-bit ids (`id_width` 3,
when every id fits) or int32 ids (4), and of little-endian float32 (`logprob_width` 4, used only
when exact) or float64 logprobs. In Python, `PackedTokens` holds the decoded bytes (msgspec reads
and writes the base64). A packed event's `prompt_ids` / `response_ids` / `logprobs`
are empty (absent from its JSON since version 4, empty lists before).

`upcast` turns any `model_request` as decoded (version 1, or version 2 packed) into the in-memory
form with plain lists (the codec applies it, in place, on every decode: `upcast_decoded`);
`Resolver` turns references into full prompts and requests for calls fed in stream order. Both
are a few lines in any language.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

_SWAP = sys.byteorder != "little"
IdArray = np.ndarray[Any, np.dtype[np.int32]]
"""Token ids as one int32 array (what the proxy parses a long prompt's ids into)."""
_FloatArray = np.ndarray[Any, np.dtype[np.float64]]
# dtype objects made once: numpy parses a dtype string on every call that names one.
_I4, _U4, _F4, _F8 = np.dtype("<i4"), np.dtype("<u4"), np.dtype("<f4"), np.dtype("<f8")


class CallRef(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """Where a call's prompt and request continue an earlier call of the same attempt."""

    event_id: str
    """The referenced `model_request` event (same rollout, same attempt, status ok, earlier on the subject)."""
    seq: int = 0
    """Its stream sequence (0 when unknown): a monitor fetches it with a direct get."""
    tokens: int = 0
    """How many tokens of the referenced call's full prompt + response ids this prompt starts with."""
    same: list[str] = []
    """Request keys whose value is the referenced call's resolved value, unchanged."""
    prefix: dict[str, int] = {}
    """Request list keys whose first n items are the referenced call's first n items."""


class PackedTokens(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """Id and logprob arrays as little-endian binary; base64 strings on the wire.

    Ids: unsigned 24-bit (`id_width` 3, when every id fits) or int32 (4). Logprobs: float32
    (`logprob_width` 4, when every value survives it exactly) or float64 (8). The fields hold the
    binary: the JSON decoder reads the base64 straight into bytes (no string is made to be decoded
    again), and the encoder writes it back as base64.
    """

    prompt: bytes = b""
    response: bytes = b""
    logprobs: bytes = b""
    logprob_width: int = 8
    id_width: int = 4


P = TypeVar("P", bound="_Packable")
C = TypeVar("C", bound="_Call")


class UnresolvedReference(LookupError):
    """A call references an event the resolver has not seen (read the attempt's calls from its start)."""


# ---- packing ------------------------------------------------------------------------------------


def pack_ids(values: Sequence[int] | IdArray, width: int = 4) -> bytes:
    """Ids (a list, or an int32 array) as little-endian int32 (`width` 4), or as unsigned 24-bit integers (`width` 3).

    Raises OverflowError for an id outside the width's range.
    """
    packed = _int32_array(values)
    if width == 3 and _id_width(packed) == 4:
        raise OverflowError("an id does not fit in 24 bits")
    return _id_bytes(packed, width)


def _int32_array(values: Sequence[int] | IdArray) -> np.ndarray[Any, Any]:
    """Ids as a little-endian int32 array (the array itself when it is one; OverflowError past int32)."""
    return np.asarray(values, dtype="<i4") if len(values) else np.zeros(0, dtype="<i4")


def _id_width(packed: np.ndarray[Any, Any]) -> int:
    """3 when every id of the int32 array fits in 24 bits, else 4."""
    return 4 if len(packed) and (int(packed.min()) < 0 or int(packed.max()) >= 1 << 24) else 3


def _id_bytes(packed: np.ndarray[Any, Any], width: int) -> bytes:
    """An int32 array's ids, `width` bytes each (3: each id's low three bytes)."""
    return packed.view(np.uint8).reshape(-1, 4)[:, :3].tobytes() if width == 3 else packed.tobytes()


def unpack_ids(data: bytes, width: int = 4) -> list[int]:
    """The ids packed by `pack_ids`."""
    return _int32_view(data, width).tolist()


def ids_int32(data: bytes, width: int = 4) -> bytes:
    """Packed ids as little-endian int32 bytes, whatever their width on the wire."""
    return data if width != 3 else _int32_view(data, 3).tobytes()


def floats_float64(data: bytes, width: int) -> bytes:
    """Packed logprobs as little-endian float64 bytes, whatever their width on the wire (4 or 8)."""
    return data if width == 8 else np.frombuffer(data, dtype=_F4).astype(_F8).tobytes()


def _int32_view(data: bytes, width: int, more: bytes = b"") -> np.ndarray[Any, Any]:
    """Ids of `width` bytes each (`data` then `more`) as an int32 array (a view for int32, one copy for 24-bit).

    A 24-bit id is read as the 4 bytes at its 3-byte offset (one padding byte closes the buffer)
    with its top byte masked off: two numpy operations, however many ids.
    """
    size = len(data) + len(more)
    if width != 3:
        if size % 4:
            raise ValueError(f"{size} bytes are not whole 32-bit ids")
        return np.frombuffer(data + more if more else data, dtype=_I4)
    count, rest = divmod(size, 3)
    if rest:
        raise ValueError(f"{size} bytes are not whole 24-bit ids")
    if not count:
        return np.zeros(0, dtype=_I4)
    ids = np.ndarray((count,), dtype=_U4, buffer=data + more + b"\0", strides=(3,)).astype(_I4)
    ids &= 0xFFFFFF
    return ids


def pack_floats(values: Sequence[float]) -> tuple[bytes, int]:
    """Logprobs as little-endian float32 when every value survives it exactly, else float64."""
    narrow = array("f", values)
    width = 4 if narrow.tolist() == list(values) else 8
    packed = narrow if width == 4 else array("d", values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes(), width


def unpack_floats(data: bytes, width: int) -> list[float]:
    """The floats packed by `pack_floats` (`width` 4 or 8)."""
    return _float_array(data, width).tolist()


def pack(ids: Sequence[int] | IdArray, response: Sequence[int], logprobs: Sequence[float]) -> PackedTokens:
    """The packed form of one call's prompt ids (or their new suffix), response ids and logprobs.

    Both id lists are packed as one array (one width, one pass: a short call's numpy calls cost
    more than its ids) and split after."""
    text, width = pack_floats(logprobs)
    both = np.concatenate((_int32_array(ids), _int32_array(response)))
    ids_width = _id_width(both)
    data = _id_bytes(both, ids_width)
    cut = len(ids) * ids_width
    return PackedTokens(
        prompt=data[:cut],
        response=data[cut:],
        logprobs=text,
        logprob_width=width,
        id_width=ids_width,
    )


class _Packable(Protocol):
    @property
    def packed(self) -> PackedTokens | UnsetType | None: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def response_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[float]: ...


def upcast(event: P) -> P:
    """A decoded `model_request` (version 1, or 2 with packed arrays) in the in-memory form: plain lists.

    Version-1 events already are; a packed version-2 event gets its arrays unpacked. References
    are left as they are (`Resolver` needs the earlier calls).
    """
    packed = event.packed
    if not packed:
        return event
    prompt, response, logprobs = _unpacked(event)
    return msgspec.structs.replace(  # type: ignore[type-var]
        event,
        packed=UNSET,
        prompt_ids=prompt,
        response_ids=response,
        logprobs=logprobs,
    )


def upcast_decoded(event: P) -> P:
    """`upcast` for an event just decoded that nothing else holds yet: its arrays are unpacked in place.

    What the codec and the replay apply on every decode; skips copying the event (frozen Structs
    are otherwise rebuilt whole to change a field).
    """
    packed = event.packed
    if not packed:
        return event
    arrays = _unpacked(event)
    put = msgspec.structs.force_setattr
    put(event, "prompt_ids", arrays[0])  # type: ignore[arg-type]
    put(event, "response_ids", arrays[1])  # type: ignore[arg-type]
    put(event, "logprobs", arrays[2])  # type: ignore[arg-type]
    put(event, "packed", UNSET)  # type: ignore[arg-type]
    return event


def _unpacked(event: _Packable) -> tuple[list[int], list[int], list[float]]:
    prompt, response, logprobs = unpack_arrays(event)
    return prompt.tolist(), response.tolist(), logprobs.tolist()


def unpack_arrays(event: _Packable) -> tuple[IdArray, IdArray, _FloatArray]:
    """A call's prompt ids, response ids and logprobs as numpy arrays (int32, int32, float64), packed or not.

    What a bulk reader (the trainer, the replay) takes instead of `upcast`: no Python int or float
    is made per token. Packed id arrays may be read-only views of the decoded bytes; an array the
    event does not pack is its list, converted. The prompt and response ids are read as one array
    and cut in two. Raises ValueError for packed arrays of a width or length that is not whole values.
    """
    packed = event.packed
    if not packed:
        return _ids(event.prompt_ids), _ids(event.response_ids), _floats(event.logprobs)
    width, prompt, response = packed.id_width, packed.prompt, packed.response
    _check_widths(packed)
    logprobs = _float_array(packed.logprobs, packed.logprob_width) if packed.logprobs else _floats(event.logprobs)
    if prompt and response and not len(prompt) % width:
        ids = _int32_view(prompt, width, response)
        cut = len(prompt) // width
        return ids[:cut], ids[cut:], logprobs
    return (
        _int32_view(prompt, width) if prompt else _ids(event.prompt_ids),
        _int32_view(response, width) if response else _ids(event.response_ids),
        logprobs,
    )


def unpack_together(
    events: Sequence[_Packable],
) -> tuple[list[tuple[IdArray, IdArray, _FloatArray]], IdArray | None]:
    """`unpack_arrays` of many calls (a rollout's), with a few numpy operations for all of them,
    and the one array all their ids were read from (None when each call was unpacked alone).

    When every call is packed alike (ids of one width, logprobs of one width, no plain lists),
    all their ids are read as one array (each call's recorded prompt ids, then its response ids,
    call after call) and all their logprobs as another, and each call gets its slices: a numpy
    operation costs about a microsecond whatever its size, and a call of a long rollout holds a
    few hundred new tokens. A call whose reference takes the whole of the call before it then has
    its full prompt as a slice of the ids array too, with no copy. Otherwise (or when a length is
    not whole values) each call is unpacked alone, so an error names its call's arrays.
    """
    packed = _packed_alike(events)
    if packed is None:
        return [unpack_arrays(event) for event in events], None
    width, lp_width = packed[0].id_width, packed[0].logprob_width
    ids = _int32_view(b"".join([part for p in packed for part in (p.prompt, p.response)]), width)
    logprobs = _float_array(b"".join([p.logprobs for p in packed]), lp_width)
    out = []
    at = lp_at = 0
    for p in packed:
        cut = at + len(p.prompt) // width
        end = cut + len(p.response) // width
        lp_end = lp_at + len(p.logprobs) // lp_width
        out.append((ids[at:cut], ids[cut:end], logprobs[lp_at:lp_end]))
        at, lp_at = end, lp_end
    return out, ids


def _packed_alike(events: Sequence[_Packable]) -> list[PackedTokens] | None:
    """The calls' packed arrays when all are packed with one id width and one logprob width, in
    whole values, with no plain list beside them; else None."""
    packed: list[PackedTokens] = []
    for event in events:
        if not event.packed or event.prompt_ids or event.response_ids or event.logprobs:
            return None
        packed.append(event.packed)
    if not packed:
        return None
    width, lp_width = packed[0].id_width, packed[0].logprob_width
    for p in packed:
        if p.id_width != width or p.logprob_width != lp_width or not _readable(p):
            return None
    return packed


def _readable(packed: PackedTokens) -> bool:
    """Known widths and whole values: the arrays unpack."""
    width, lp_width = packed.id_width, packed.logprob_width
    return (
        width in (3, 4)
        and lp_width in (4, 8)
        and not (len(packed.prompt) % width or len(packed.response) % width or len(packed.logprobs) % lp_width)
    )


def _check_widths(packed: PackedTokens) -> None:
    if packed.id_width not in (3, 4) or packed.logprob_width not in (4, 8):
        raise ValueError(
            f"id_width {packed.id_width}, logprob_width {packed.logprob_width}: ids take 3 or 4, logprobs 4 or 8"
        )


def check_packed(packed: PackedTokens) -> None:
    """Raise ValueError unless the arrays unpack: known widths, whole values (nothing is unpacked).

    What a decode that leaves the arrays packed checks instead of unpacking them (the same errors).
    """
    if _readable(packed):  # the common path, one test: this runs on every call of a typed read
        return
    _check_widths(packed)
    width = packed.id_width
    for name, data in (("prompt", packed.prompt), ("response", packed.response)):
        if len(data) % width:
            raise ValueError(f"{name}: {len(data)} bytes are not whole {8 * width}-bit ids")
    raise ValueError(f"{len(packed.logprobs)} bytes are not whole {packed.logprob_width}-byte floats")


def _ids(values: Sequence[int]) -> IdArray:
    return np.asarray(values, dtype=np.int32)


def _floats(values: Sequence[float]) -> _FloatArray:
    return np.asarray(values, dtype=np.float64)


def _float_array(data: bytes, width: int) -> _FloatArray:
    if len(data) % width:
        raise ValueError(f"{len(data)} bytes are not whole {width}-byte floats")
    if width == 4:
        return np.frombuffer(data, dtype=_F4).astype(np.float64)
    return np.frombuffer(data, dtype=_F8)


def prompt_length(event: Any) -> int:
    """How many prompt tokens a call consumed, whether or not its prompt is a reference or packed."""
    ref, packed = event.prompt_ref, event.packed
    stored = len(packed.prompt) // packed.id_width if packed and packed.prompt else len(event.prompt_ids)
    return stored + (ref.tokens if ref else 0)


def response_length(event: Any) -> int:
    """How many tokens a call sampled, its arrays packed or not."""
    packed = event.packed
    return len(packed.response) // packed.id_width if packed and packed.response else len(event.response_ids)


# ---- resolving ----------------------------------------------------------------------------------


class _Call(Protocol):
    @property
    def event_id(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def prompt_ref(self) -> CallRef | UnsetType | None: ...
    @property
    def packed(self) -> PackedTokens | UnsetType | None: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def response_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[float]: ...


def resolve_request(request: dict[str, Any], ref: CallRef, earlier: dict[str, Any]) -> dict[str, Any]:
    """A request copy with the referenced call's inherited keys and list prefixes put back."""
    full = {key: earlier[key] for key in ref.same if key in earlier}
    for key, value in request.items():
        n = ref.prefix.get(key)
        if n is not None and isinstance(value, list):
            full[key] = [*earlier.get(key, [])[:n], *value]
        else:
            full[key] = value
    for key, n in ref.prefix.items():
        if key not in full:
            full[key] = list(earlier.get(key, [])[:n])
    return full


class Resolver:
    """Turns references into full prompts (and requests) for calls fed in stream order.

    Remembers each `ok` call's full token sequence (prompt + response) and request by event id,
    least recently used evicted past `max_bytes` (a call referencing an evicted one raises
    `UnresolvedReference`; a replay of one rollout at a time never does with the default).
    """

    def __init__(self, *, max_bytes: int = 1 << 30, requests: bool = True) -> None:
        self.max_bytes = max_bytes
        self.requests = requests
        self.size = 0
        self.seen: OrderedDict[str, tuple[list[int], dict[str, Any] | None]] = OrderedDict()

    def prompt(self, call: _Call) -> list[int]:
        """The call's full prompt ids (packed arrays unpacked)."""
        ref = call.prompt_ref
        prompt = upcast(call).prompt_ids
        if ref:
            prompt = [*self._earlier(ref)[0][: ref.tokens], *prompt]
        return prompt

    def _earlier(self, ref: CallRef) -> tuple[list[int], dict[str, Any] | None]:
        earlier = self.seen.get(ref.event_id)
        if earlier is None:
            raise UnresolvedReference(f"the referenced call {ref.event_id} (stream sequence {ref.seq}) was not seen")
        self.seen.move_to_end(ref.event_id)
        return earlier

    def remember(self, call: _Call, prompt: list[int], request: dict[str, Any] | None = None) -> None:
        """Keep an `ok` call's full sequence (and request) for the calls that reference it."""
        if call.status != "ok":
            return
        tokens = [*prompt, *call.response_ids]
        self.seen[call.event_id] = (tokens, request if self.requests else None)
        self.size += 8 * len(tokens)
        while self.size > self.max_bytes and len(self.seen) > 1:
            _, (old, _request) = self.seen.popitem(last=False)
            self.size -= 8 * len(old)

    def resolve(self, call: C) -> C:
        """The call with its full prompt ids (and full request when it has one), remembered for later calls.

        Packed arrays come back unpacked (`upcast`): the full call is in the in-memory form.
        """
        call = upcast(call)
        ref = call.prompt_ref
        if not ref:
            self.remember(call, call.prompt_ids, getattr(call, "request", None))
            return call
        tokens, earlier_request = self._earlier(ref)
        prompt = [*tokens[: ref.tokens], *call.prompt_ids]
        changes: dict[str, Any] = {"prompt_ids": prompt, "prompt_ref": UNSET}
        request = getattr(call, "request", None)
        if request is not None and self.requests:
            request = resolve_request(request, ref, earlier_request or {})
            changes["request"] = request
        resolved = msgspec.structs.replace(call, **changes)  # type: ignore[type-var]
        self.remember(resolved, prompt, request)
        return resolved


class ArrayResolver:
    """`Resolver`'s array form: full prompts as int32 numpy arrays, for a bulk reader of one attempt's calls.

    What the trainer (and the replay) use: the calls' arrays come from `unpack_arrays` or
    `unpack_together`, and each call that references an earlier one gets that call's prompt +
    response cut at `prompt_ref.tokens`, then its own ids (one array built, the earlier arrays
    shared). `prompt` also says which reference the full prompt continues: None for an event id
    the attempt recorded twice (ambiguous; the later one is the one resolved).

    When the calls' ids were read as one array (`joined`: each call's recorded ids in turn, as
    `unpack_together` returns it), a call that takes the whole of the call before it, as a
    conversation's next turn does, finds its full prompt already there: a slice, no array built.
    """

    __slots__ = ("at", "joined", "repeated", "seen", "tail")

    def __init__(self, joined: IdArray | None = None) -> None:
        self.seen: dict[str, tuple[IdArray, IdArray]] = {}
        self.repeated: set[str] = set()
        self.joined = joined
        self.at = 0  # where the next call's recorded ids start in `joined`
        # (event id, start) of the last call when its full prompt and response are joined[start:at]
        self.tail: tuple[str, int] | None = None

    def prompt(
        self, event_id: str, ref: CallRef | UnsetType | None, prompt: IdArray, response: IdArray
    ) -> tuple[IdArray, CallRef | None]:
        """A call's full prompt (its recorded `prompt` and `response` given, in stream order) and its usable reference.

        Raises `UnresolvedReference` when the referenced call was not seen (and so not resolved).
        """
        start, tail = self.at, self.tail
        self.at += len(prompt) + len(response)
        self.tail = None
        if ref:
            earlier = self.seen.get(ref.event_id)
            if earlier is None:
                raise UnresolvedReference(
                    f"the referenced call {ref.event_id} (stream sequence {ref.seq}) was not seen"
                )
            before, said = earlier
            shared = ref.tokens
            if self.joined is not None and tail == (ref.event_id, start - shared):
                prompt = self.joined[start - shared : start + len(prompt)]
                self.tail = (event_id, start - shared)
            elif shared <= len(before):
                prompt = np.concatenate((before[:shared], prompt))
            else:
                prompt = np.concatenate((before, said[: shared - len(before)], prompt))
        elif self.joined is not None:
            self.tail = (event_id, start)
        usable = ref if ref and ref.event_id not in self.repeated else None
        if event_id in self.seen:
            self.repeated.add(event_id)
        self.seen[event_id] = (prompt, response)
        return prompt, usable
