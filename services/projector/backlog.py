"""The bounded hand-off between the projector's fetcher and writer (its backpressure).

Batches wait here between being prepared and being written. A put waits while the backlog holds
`max_batches` batches or `max_bytes` bytes of messages, so memory stays bounded whatever the
size of the events (a 2,000-token call and a 100,000-token one count for what they weigh), and
the rest of the stream waits in JetStream. A batch is always accepted into an empty backlog, so a
single batch larger than `max_bytes` still makes progress.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Backlog(Generic[T]):
    """A FIFO of batches bounded by count and by bytes, for one producer and one consumer."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: deque[tuple[T, int]] = deque()
        self._space = asyncio.Event()
        self._ready = asyncio.Event()
        self._space.set()

    def __len__(self) -> int:
        return len(self._items)

    def _full(self) -> bool:
        return bool(self._items) and (len(self._items) >= self.max_batches or self.bytes >= self.max_bytes)

    def _changed(self) -> None:
        if self._full():
            self._space.clear()
        else:
            self._space.set()
        if self._items:
            self._ready.set()
        else:
            self._ready.clear()

    async def put(self, item: T, size: int) -> None:
        """Add a batch of `size` bytes, waiting while the backlog is full."""
        while self._full():
            await self._space.wait()
        self._items.append((item, size))
        self.bytes += size
        self._changed()

    async def get(self) -> T:
        """The oldest batch, waiting for one."""
        while not self._items:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> T | None:
        """The oldest batch, or None when the backlog is empty."""
        return self._take() if self._items else None

    def _take(self) -> T:
        item, size = self._items.popleft()
        self.bytes -= size
        self._changed()
        return item
