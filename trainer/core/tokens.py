"""Token id and logprob arrays: what a call and a sample hold, and the few operations on them.

The adapter holds a call's ids and logprobs as numpy arrays (int32 ids, float64 logprobs): a
replay of a large run then never makes one Python int per token, and merging, comparing and
slicing are single array operations. Callers may still pass plain lists (tests, hand-built
calls); each operation here takes either and converts without copying an array it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

IdArray = np.ndarray[Any, np.dtype[np.int32]]
FloatArray = np.ndarray[Any, np.dtype[np.float64]]
TokenIds = IdArray | Sequence[int]
"""Token ids as a call or sample holds them: an int32 array, or any sequence of ints."""
Logprobs = FloatArray | Sequence[float]
"""Per-token log-probabilities: a float64 array, or any sequence of floats."""

EMPTY_IDS: IdArray = np.zeros(0, dtype=np.int32)


def as_ids(values: TokenIds) -> IdArray:
    """The ids as an int32 array (the array itself when it already is one)."""
    return np.asarray(values, dtype=np.int32)


def as_floats(values: Logprobs) -> FloatArray:
    """The values as a float64 array (the array itself when it already is one)."""
    return np.asarray(values, dtype=np.float64)


def same_ids(a: TokenIds, b: TokenIds) -> bool:
    """True when both hold the same ids in the same order."""
    # Comparing the arrays' bytes is an order of magnitude faster than `np.array_equal` at these sizes.
    return len(a) == len(b) and as_ids(a).tobytes() == as_ids(b).tobytes()


def joined(*parts: TokenIds) -> IdArray:
    """The parts' ids one after the other, as one new array."""
    return np.concatenate([as_ids(p) for p in parts]) if parts else EMPTY_IDS


def plain(value: Any) -> Any:
    """`value` with every array as a list and every Struct as a dict: for comparing, printing, JSON."""
    return msgspec.to_builtins(value, enc_hook=_plain_array)


def _plain_array(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise NotImplementedError(f"{type(value).__name__} has no plain form")
