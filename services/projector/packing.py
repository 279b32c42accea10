"""Compact binary form of token ids and logprobs: little-endian int32 and float64 arrays.

A 2,000-token prompt packs to 8 kB of `bytea`, which Postgres stores and COPYs several times faster
than an `integer[]` of the same ids. SQL users unpack with `rollwire_int32s` / `rollwire_float64s`.

`pack_int32_json` packs straight from the JSON text of an event's id list. With numpy installed
it parses the text in C without making a Python int per token (the projector's hottest step);
anything numpy does not read cleanly goes through msgspec, which also names what is wrong.
"""

from __future__ import annotations

import sys
import warnings
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec

_np: Any
try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is optional
    _np = None

_SWAP = sys.byteorder != "little"
# A partial parse is detected by counting values; numpy's warning about it would only be noise.
warnings.filterwarnings("ignore", message="string or file could not be read to its end", module=__name__)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_ints = msgspec.json.Decoder(list[int])
_floats = msgspec.json.Decoder(list[float])


def _pack(code: str, values: Sequence[Any]) -> bytes:
    """`values` as a little-endian array of `code` ("i": int32, "d": float64)."""
    packed = array(code, values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(code: str, data: bytes) -> list[Any]:
    """The values `_pack(code, ...)` packed."""
    packed = array(code)
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


def pack_int32(values: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (raises OverflowError outside the int32 range)."""
    return _pack("i", values)


def unpack_int32(data: bytes) -> list[int]:
    """The ids packed by `pack_int32`."""
    return _unpack("i", data)


def pack_float64(values: Sequence[float]) -> bytes:
    """Logprobs as little-endian float64 bytes (exact: the events carry float64)."""
    return _pack("d", values)


def unpack_float64(data: bytes) -> list[float]:
    """The floats packed by `pack_float64`."""
    return _unpack("d", data)


def json_column(text: str | None) -> Any:
    """A `json`/`jsonb`-as-text column's value decoded (None stays None)."""
    return None if text is None else msgspec.json.decode(text)


def _fast_int32(text: bytes) -> bytes | None:
    text = text.strip()
    if _np is None or text[:1] != b"[" or text[-1:] != b"]":
        return None
    inner = text[1:-1]
    if not inner.strip():
        return b""
    try:
        values = _np.fromstring(inner, dtype=_np.int64, sep=",")
    except ValueError:
        return None
    if len(values) != inner.count(b",") + 1 or values.min() < _INT32_MIN or values.max() > _INT32_MAX:
        return None
    return bytes(values.astype("<i4").tobytes())


def pack_int32_json(text: bytes) -> bytes:
    """Packed int32 ids from a JSON array of ints (msgspec.ValidationError or OverflowError if it is not)."""
    fast = _fast_int32(text)
    return fast if fast is not None else pack_int32(_ints.decode(text))


def pack_float64_json(text: bytes) -> bytes:
    """Packed float64 values from a JSON array of numbers."""
    return pack_float64(_floats.decode(text))


class PromptCache:
    """Packs a conversation's prompts by parsing only what each adds to the previous one.

    An agent's next prompt is its previous prompt plus the response and an observation, so the
    JSON text of the new id list starts with the previous text up to its closing bracket. When it
    does, and a comma follows (a token boundary), the packed previous prompt is reused and only
    the rest is parsed. Anything else falls back to a full parse, so the cache only saves work.
    Entries are kept per conversation key, least recently used evicted past `max_bytes`.
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self.entries: OrderedDict[object, tuple[bytes, bytes]] = OrderedDict()
        self.hits = 0

    def pack(self, key: object, text: bytes) -> bytes:
        """`pack_int32_json(text)`, reusing the previous prompt of `key` when `text` extends it."""
        cached = self.entries.pop(key, None)
        packed: bytes | None = None
        if cached is not None:
            self.size -= len(cached[0]) + len(cached[1])
            head, head_packed = cached
            if len(text) > len(head) and text.startswith(head) and text[len(head) : len(head) + 1] == b",":
                packed = head_packed + pack_int32_json(b"[" + text[len(head) + 1 :])
                self.hits += 1
        if packed is None:
            packed = pack_int32_json(text)
        head = text.rstrip()[:-1]  # the text without its closing bracket
        if packed and len(head) + len(packed) <= self.max_bytes:
            self.entries[key] = (head, packed)
            self.size += len(head) + len(packed)
            while self.size > self.max_bytes:
                _, (old_head, old_packed) = self.entries.popitem(last=False)
                self.size -= len(old_head) + len(old_packed)
        return packed
