"""A deadline on one future that nothing else awaits: failed in place once its time is up.

`asyncio.wait_for(asyncio.shield(f), t)` and `async with asyncio.timeout(t)` each cost several
objects and callbacks per wait; the proxy waits like this four or five times on every call (the
engine's status line and body, the marker's, the claim's and the record's acks). A future that
belongs to the waiting call alone can instead be failed where it is, and cancelled with the waiting
task: nobody else is harmed by either. The cancellation of the waiting task is kept, as with
`asyncio.timeout`.

Nor does each wait get a timer of its own: a loop timer set and cancelled cost 2.4 to 3.7 us on
uvloop (timed on a 2-core VM), against 1.3 us for an entry in the loop's table of waits, added and
removed. One timer per event loop checks the table every `TICK_S` while it holds a wait, so a wait fails
between its deadline and `TICK_S` after it; the deadlines here are seconds long.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
TICK_S = 0.05
"""How often an event loop's waits are checked while it has any: how late a deadline may fire."""


async def within(future: asyncio.Future[T], timeout_s: float, timed_out: Callable[[], BaseException]) -> T:
    """The future's result, or the exception `timed_out()` makes when none came in `timeout_s` seconds."""
    deadline = fail_after(future, timeout_s, timed_out)
    try:
        return await future
    finally:
        deadline.cancel()


def fail_after(future: asyncio.Future[T], timeout_s: float, timed_out: Callable[[], BaseException]) -> Deadline:
    """Fail the future with `timed_out()` unless it is done in `timeout_s` seconds (cancel the deadline when it is).

    The future's own loop times it: `get_running_loop` would cost a `getpid` system call on Python 3.11."""
    loop = future.get_loop()
    waits = _waits.get(loop)
    if waits is None:
        waits = _waits[loop] = _Waits()
    return waits.add(loop, future, loop.time() + timeout_s, timed_out)


class Deadline:
    """A future's place in its loop's table of waits (`cancel` once it is done, or no longer awaited)."""

    __slots__ = ("_future", "_table")

    def __init__(self, table: dict[asyncio.Future[Any], tuple[float, Callable[[], BaseException]]], future: Any):
        self._table, self._future = table, future

    def cancel(self) -> None:
        """Drop the deadline (nothing happens to the future)."""
        self._table.pop(self._future, None)


class _Waits:
    """One event loop's futures with deadlines, and whether its timer checks them (while there are any)."""

    def __init__(self) -> None:
        self.table: dict[asyncio.Future[Any], tuple[float, Callable[[], BaseException]]] = {}
        self.ticking = False

    def add(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        at: float,
        timed_out: Callable[[], BaseException],
    ) -> Deadline:
        self.table[future] = (at, timed_out)
        if not self.ticking:
            self.ticking = True
            loop.call_later(TICK_S, self._check)
        return Deadline(self.table, future)

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        expired = [(future, why) for future, (at, why) in self.table.items() if at <= now or future.done()]
        for future, timed_out in expired:
            del self.table[future]
            if not future.done():
                future.set_exception(timed_out())
        self.ticking = bool(self.table)
        if self.ticking:
            loop.call_later(TICK_S, self._check)


_waits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waits] = weakref.WeakKeyDictionary()
