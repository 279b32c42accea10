"""One generation thread that interleaves all requests token by token.

Torch runs outside the event loop (it releases the GIL in its kernels), so the HTTP server stays
responsive while tokens are produced. Each request is a `Job` wrapping a step iterator
(`services.engine.generation.generate`); the thread advances every active job by one step per
round, so a long generation does not hold back the first token of a new request. Each step's
deltas are handed to the request's event loop as soon as they exist, which is what makes a
stream's time to first token real. A cancelled job (client gone) is dropped before its next step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Generator

import torch

from services.engine.output import TokenDelta

log = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The engine shut down before the request finished; retry against a running engine."""


class GenerationFailedError(RuntimeError):
    """Generation raised inside the engine; the message carries the cause."""


_DONE = object()


class Job:
    """One request's generation, produced in the scheduler thread and consumed in the event loop."""

    def __init__(
        self,
        steps: Generator[list[TokenDelta], None, None],
        loop: asyncio.AbstractEventLoop,
        report_steps: bool = True,
    ) -> None:
        self.steps = steps
        self.report_steps = report_steps  # False: only the end is reported (no wake-up per token)
        self._loop = loop
        self._items: collections.deque[object] = collections.deque()
        self._lock = threading.Lock()
        self._wake_pending = False  # a wake-up is scheduled and the consumer has not drained since
        self._ready = asyncio.Event()
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        """True once the consumer went away; the scheduler drops the job before its next step."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the scheduler to stop generating for this job."""
        self._cancelled.set()

    def post(self, item: object) -> None:
        """Hand an item to the consumer (called from the scheduler thread).

        Items that pile up while the event loop is busy are delivered in one wake-up, so a loaded
        machine costs fewer thread switches instead of one per token.
        """
        with self._lock:
            self._items.append(item)
            if self._wake_pending:
                return
            self._wake_pending = True
        with contextlib.suppress(RuntimeError):  # the event loop is already closed: nobody is listening
            self._loop.call_soon_threadsafe(self._ready.set)

    def _drain(self) -> list[object]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._wake_pending = False
            self._ready.clear()
        return items

    async def deltas(self) -> AsyncIterator[list[TokenDelta]]:
        """Each step's deltas as they are produced (none unless report_steps); raises if generation failed."""
        while True:
            await self._ready.wait()
            for item in self._drain():
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item  # type: ignore[misc]


class Scheduler:
    """The generation thread (see the module docstring)."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._open = 0
        self._thread = threading.Thread(target=self._run, name="rollwire-engine-generation", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        """Jobs submitted and not yet finished or dropped."""
        with self._lock:
            return self._open

    def submit(self, job: Job) -> None:
        """Queue a job; its deltas arrive on `job.deltas()`."""
        if not self._thread.is_alive():
            raise EngineClosedError("the engine is shut down")
        with self._lock:
            self._open += 1
        self._inbox.put(job)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; unfinished jobs get EngineClosedError."""
        self._inbox.put(None)
        self._thread.join(timeout)

    def _finish(self, job: Job, item: object) -> None:
        job.post(item)
        with contextlib.suppress(Exception):
            job.steps.close()
        with self._lock:
            self._open -= 1

    def _step(self, job: Job) -> bool:
        """Advance one job by one step; False when it is done."""
        if job.cancelled:
            self._finish(job, _DONE)
            return False
        try:
            deltas = next(job.steps)
            if job.report_steps:
                job.post(deltas)
        except StopIteration:
            self._finish(job, _DONE)
            return False
        except Exception as exc:
            log.exception("generation failed")
            self._finish(job, GenerationFailedError(f"generation failed: {exc!r}"))
            return False
        return True

    def _run(self) -> None:
        active: list[Job] = []
        with torch.inference_mode():
            while True:
                incoming: list[Job | None] = []
                try:
                    incoming.append(self._inbox.get(block=not active))
                    while True:
                        incoming.append(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                if any(item is None for item in incoming):
                    for job in active + [j for j in incoming if j is not None]:
                        self._finish(job, EngineClosedError("the engine shut down during generation"))
                    return
                active.extend(j for j in incoming if j is not None)
                active = [job for job in active if self._step(job)]
