"""A deadline on one future that nothing else awaits: a timer that fails it in place.

`asyncio.wait_for(asyncio.shield(f), t)` and `async with asyncio.timeout(t)` each cost several
objects and callbacks per wait; the proxy waits like this three times on every call (the engine's
status line, each ack). A future that belongs to the waiting call alone can instead be failed by a
timer, and cancelled with the waiting task: nobody else is harmed by either. The cancellation of the
waiting task is kept, as with `asyncio.timeout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def within(future: asyncio.Future[T], timeout_s: float, timed_out: Callable[[], BaseException]) -> T:
    """The future's result, or the exception `timed_out()` makes when none came in `timeout_s` seconds."""
    timer = fail_after(future, timeout_s, timed_out)
    try:
        return await future
    finally:
        timer.cancel()


def fail_after(
    future: asyncio.Future[T], timeout_s: float, timed_out: Callable[[], BaseException]
) -> asyncio.TimerHandle:
    """Fail the future with `timed_out()` unless it is done in `timeout_s` seconds (cancel the handle when it is)."""
    return asyncio.get_running_loop().call_later(timeout_s, _expire, future, timed_out)


def _expire(future: asyncio.Future[T], timed_out: Callable[[], BaseException]) -> None:
    if not future.done():
        future.set_exception(timed_out())
