"""A least-recently-used map bounded by the bytes its values take, not by how many there are.

Agents are untrusted and choose how big what they send is: a cache capped at 20,000 entries of
1 MB each is a 20 GB cache. Every cache in Rollwire that holds what a client sent or was sent is
a `ByteLRU`: each entry is charged its size (the caller says how to measure it, plus a fixed
overhead per entry), and the oldest entries go once the total passes `max_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

ENTRY_OVERHEAD = 256
"""Bytes charged per entry on top of its measured size (key, bookkeeping)."""


class ByteLRU(Generic[K, V]):
    """LRU map whose values' measured sizes sum to at most `max_bytes` (an entry larger than the
    whole budget is not kept at all)."""

    def __init__(self, max_bytes: int, size_of: Callable[[V], int]) -> None:
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._entries))

    def get(self, key: K) -> V | None:
        """The value (marked recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V) -> None:
        """Store `value`, charging its size, and evict the oldest entries past the budget."""
        self.pop(key)
        size = self._size_of(value) + ENTRY_OVERHEAD
        if size > self.max_bytes:
            return
        self._entries[key] = (value, size)
        self.bytes += size
        self._evict()

    def resize(self, key: K) -> None:
        """Re-measure an entry whose value changed in place."""
        entry = self._entries.get(key)
        if entry is not None:
            self.put(key, entry[0])

    def pop(self, key: K) -> V | None:
        """Remove and return the value, or None."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.bytes -= entry[1]
        return entry[0]

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()
        self.bytes = 0

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            _, (_, size) = self._entries.popitem(last=False)
            self.bytes -= size
