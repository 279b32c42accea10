"""Deadlines on futures (`services/common/deadline.py`): one timer per event loop, not one per wait."""

from __future__ import annotations

import asyncio
import threading

import pytest
import uvloop

from services.common import deadline
from services.common.deadline import fail_after, within

CLOCK_S = 0.001
"""uvloop's `loop.time()` counts milliseconds: sums of its readings are off by float rounding (0.1499999...)."""


class Late(Exception):
    pass


def _run(main: object) -> object:
    return uvloop.run(main)  # type: ignore[arg-type]  # the proxy's loop


def test_a_wait_fails_at_its_deadline_and_not_before() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        waited = []
        for timeout in (0.05, 0.12, 0.3):
            began = loop.time()
            with pytest.raises(Late):
                await within(loop.create_future(), timeout, Late)
            waited.append(loop.time() - began - timeout)
        return waited

    late = _run(main())
    # Never early; late by a tick (`TICK_S`), more on a loaded machine.
    assert all(-CLOCK_S <= by < 1 for by in late), late


def test_a_done_future_keeps_its_result_and_the_timer_stops() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        loop.call_later(0.01, future.set_result, 7)
        assert await within(future, 0.2, Late) == 7
        await asyncio.sleep(0.3)  # past the deadline: nothing is set on it
        assert future.result() == 7
        waits = deadline._waits[loop]
        assert waits.table == {} and not waits.ticking  # an idle loop has no timer checking

    _run(main())


def test_a_cancelled_wait_cancels_its_future_and_no_deadline_fails_it() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        waiting = asyncio.ensure_future(within(future, 0.1, Late))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.2)
        assert future.cancelled()  # cancelled with the waiting task, as `asyncio.timeout` does; not failed

    _run(main())


def test_a_cancelled_deadline_never_fires() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        fail_after(future, 0.05, Late).cancel()
        other = loop.create_future()
        fail_after(other, 0.05, Late)
        await asyncio.sleep(0.2)
        assert not future.done() and isinstance(other.exception(), Late)

    _run(main())


def test_each_event_loop_keeps_its_own_deadlines() -> None:
    """Loops in threads (servers in tests, a controller's) time their waits apart, at the same time."""
    results: dict[str, object] = {}

    def wait(name: str, timeout: float) -> None:  # three waits a loop, the two loops' waits interleaved
        async def main() -> float:
            loop = asyncio.get_running_loop()
            began = loop.time()
            for _ in range(3):
                with pytest.raises(Late):
                    await within(loop.create_future(), timeout, Late)
            return loop.time() - began

        results[name] = _run(main())

    threads = [threading.Thread(target=wait, args=(name, t)) for name, t in (("short", 0.05), ("long", 0.2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 0.15 - CLOCK_S <= results["short"] < 5 and 0.6 - CLOCK_S <= results["long"] < 5, results  # type: ignore[operator]
