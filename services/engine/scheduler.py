"""One generation thread that runs every request, batched token by token.

Torch runs outside the event loop (it releases the GIL in its kernels), so the HTTP server stays
responsive while tokens are produced. Each round the thread prefills the requests that arrived
(`Batch.admit`) and then advances every batch by one token (`Batch.step`): requests on the same
weights share a batch (continuous batching), so a long generation neither holds back the first
token of a new request nor runs alone. After a reload, requests already running stay in the batch
of their old weights until they finish. Each step's deltas are handed to the request's event loop
as soon as they exist, which is what makes a stream's time to first token real. A cancelled job
(client gone) leaves its batch before the next step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import torch

from services.engine import metrics
from services.engine.generation import Batch, Generation
from services.engine.output import TokenDelta
from services.engine.weights import Weights

log = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The engine shut down before the request finished; retry against a running engine."""


class GenerationFailedError(RuntimeError):
    """Generation raised inside the engine; the message carries the cause."""


_DONE = object()


def limit_torch_threads_here(threads: int) -> None:
    """Give the calling thread its own torch intra-op thread count, leaving other threads' as they are.

    `torch.set_num_threads` also changes the default that threads initialise from. With OpenMP the
    count is kept per thread, so after initialising this thread and setting its count, the default
    is restored from a throwaway thread: this thread keeps `threads`, everyone else the default.
    """
    default = torch.get_num_threads()  # initialises this thread, so restoring the default cannot reset it
    torch.set_num_threads(threads)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="torch-threads-restore")
    restore.start()
    restore.join()


class Job:
    """One request's generation, produced in the scheduler thread and consumed in the event loop."""

    @property
    def finished(self) -> bool:
        """True once every choice has its finish reason."""
        return all(b.finished for b in self.generation.builders)

    def __init__(
        self,
        generation: Generation,
        weights: Weights,
        loop: asyncio.AbstractEventLoop,
        report_steps: bool = True,
    ) -> None:
        self.generation = generation
        self.weights = weights
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

    def __init__(self, threads: int | None = None) -> None:
        self._threads = threads
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

    @property
    def queued(self) -> int:
        """Jobs submitted and not yet taken in by the generation thread."""
        return self._inbox.qsize()

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
        with self._lock:
            self._open -= 1  # before the consumer can see the end, so `running` never lags behind it
        job.post(item)

    def _fail(self, jobs: list[Job], exc: Exception) -> None:
        log.exception("generation failed")
        for job in jobs:
            self._finish(job, GenerationFailedError(f"generation failed: {exc!r}"))

    def _admit(self, job: Job, batches: dict[int, Batch]) -> None:
        """Prefill a new job into the batch of its weights (its own batch if they cannot be shared)."""
        if job.cancelled:
            self._finish(job, _DONE)
            return
        key = id(job.weights) if job.weights.batchable else id(job)
        batch = batches.setdefault(key, Batch(job.weights))
        try:
            deltas = batch.admit(job, job.generation)
        except Exception as exc:
            batch.drop(job)
            self._fail([job], exc)
            return
        metrics.admitted(len(job.generation.prompt_ids), len(deltas))
        if job.report_steps:
            job.post(deltas)
        if job.finished:
            self._finish(job, _DONE)

    def _advance(self, batch: Batch) -> None:
        """Drop cancelled jobs, then one token for every row of the batch."""
        for job in batch.owners():
            if job.cancelled:
                batch.drop(job)
                self._finish(job, _DONE)
        if not batch.rows:
            return
        owners = batch.owners()
        began = time.perf_counter()
        try:
            results = batch.step()
        except Exception as exc:
            batch.rows.clear()
            self._fail(owners, exc)
            return
        metrics.stepped(len(results), time.perf_counter() - began)
        per_job: dict[int, list[TokenDelta]] = {}
        for job, delta in results:
            per_job.setdefault(id(job), []).append(delta)
        for job in owners:
            if job.report_steps:
                job.post(per_job[id(job)])
            if job.finished:
                self._finish(job, _DONE)

    def _run(self) -> None:
        batches: dict[int, Batch] = {}
        if self._threads:
            limit_torch_threads_here(self._threads)
        try:
            with torch.inference_mode():
                self._serve(batches)
        except Exception as exc:  # a bug here must not leave requests waiting forever
            self._fail([job for batch in batches.values() for job in batch.owners()], exc)
            raise

    def _serve(self, batches: dict[int, Batch]) -> None:
        while True:
            incoming: list[Job | None] = []
            try:
                incoming.append(self._inbox.get(block=not batches))
                while True:
                    incoming.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if any(item is None for item in incoming):
                running = [job for batch in batches.values() for job in batch.owners()]
                for job in running + [j for j in incoming if j is not None]:
                    self._finish(job, EngineClosedError("the engine shut down during generation"))
                batches.clear()
                return
            for job in incoming:
                if job is not None:
                    self._admit(job, batches)
            for key, batch in list(batches.items()):
                self._advance(batch)
                if not batch.rows:
                    del batches[key]
