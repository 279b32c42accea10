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
from collections.abc import Sequence
from typing import Any

import msgspec

_np: Any
try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is optional
    _np = None

_SWAP = sys.byteorder != "little"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_ints = msgspec.json.Decoder(list[int])
_floats = msgspec.json.Decoder(list[float])


def pack_int32(values: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (raises OverflowError outside the int32 range)."""
    packed = array("i", values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_int32(data: bytes) -> list[int]:
    """The ids packed by `pack_int32`."""
    packed = array("i")
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


def pack_float64(values: Sequence[float]) -> bytes:
    """Logprobs as little-endian float64 bytes (exact: the events carry float64)."""
    packed = array("d", values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_float64(data: bytes) -> list[float]:
    """The floats packed by `pack_float64`."""
    packed = array("d")
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


def _fast_int32(text: bytes) -> bytes | None:
    text = text.strip()
    if _np is None or text[:1] != b"[" or text[-1:] != b"]":
        return None
    inner = text[1:-1]
    if not inner.strip():
        return b""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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
