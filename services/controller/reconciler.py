"""The reconcile loop: make executions match rollouts, from the stream and the backends' listings.

What the controller knows, and from where
-----------------------------------------
It owns no state. What should run comes from the stream: run specs (`rl.<run>.run`) and each
rollout's `created`, `attempt` and `status` events, folded into a view (`view.py`). What does
run comes from the backends: `list()` and `watch()`. At start it reads those subjects to the end
of the stream and lists every backend; then a durable consumer (`controller` by default, so an
operator sees its lag with `nats consumer info`) follows new events, each backend's watch
follows executions, and a periodic resync re-lists the backends and re-checks the last status of
every rollout that has work in flight (a deleted rollout has none: its executions are stopped).

Each rollout is handled by at most one task at a time, so its events are handled in order, and
different rollouts in parallel. The task asks the pure policy (`decide.py`) what to do and does
it: commands go through the gateway's HTTP API with the admin token (one command path, with the
transition checks), executions through the backend. Starts are admitted by each run's
`concurrency` and each backend's `capacity`, oldest rollout first.

Why no execution starts twice and none is forgotten
----------------------------------------------------
One execution per attempt, keyed by (run, rollout, attempt), and every step is idempotent:

1. The attempt is started through the gateway with the `Idempotency-Key`
   `rollwire-controller:<rollout>:<created seq>:<attempt number>`. The gateway derives the
   attempt id from the key, so asking again for the same number returns the same attempt and
   token instead of a second attempt; it also refuses a start unless the rollout is queuing or
   requeuing. Two starts of the same attempt number cannot produce two attempts.
2. The backend launches by key, idempotently: a local execution is indexed before its
   supervisor forks and holds a lock from the fork on; a Kubernetes Job has a name derived from
   the key and a second create is an AlreadyExists. A launch either left an execution that
   listings show, or nothing.
3. Crash anywhere, restart, and the fold plus the listings say where things stand:
   queuing -> the attempt is started (same key, so a start that landed before the crash
   comes back as the same attempt); preparing with no execution -> `Relaunch`: the same attempt
   (same key, same token) is launched; preparing with an execution -> it is reported running;
   running -> the execution kept running without us (own session / a Job) and its end, recorded
   by the executor, is reported when seen.
4. After a command, the rollout is not decided again until the stream shows the command's
   event (the gateway returns its sequence), so a stale view never repeats a step; a conflict
   (409) re-reads the rollout from the stream.

On SIGTERM the controller stops starting, lets commands in flight finish, and exits; executions
keep running (local ones in their own session) and the next controller takes them over. Two
controllers must not serve the same runs with the same backend at once: their starts would still
converge on the same attempts, but each would act on the other's half-finished steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any

import nats.errors

from schemas import RunStarted
from schemas.rollout import fold
from schemas.run import fold as fold_run
from schemas.runs import RunSpec
from services.common.eventstore import EventStoreError, StoredEvent
from services.common.retry import Backoff
from services.controller.backends.base import (
    ExecutionState,
    PermanentBackendError,
    RolloutKey,
    TemporaryBackendError,
)
from services.controller.decide import (
    Action,
    Forget,
    Kill,
    Start,
    decide,
)
from services.controller.gateway import (
    GatewayConflict,
    GatewayRejected,
    GatewayUnavailable,
)
from services.controller.launch import UNAVAILABLE_BACKOFF, Launcher
from services.controller.state import backend_id
from services.controller.view import Rollout, compact, run_spec

log = logging.getLogger("rollwire.controller")
TEMPORARY_ERRORS: tuple[type[Exception], ...] = (
    GatewayUnavailable,
    TemporaryBackendError,
    EventStoreError,
    nats.errors.Error,
    ConnectionError,
    TimeoutError,
)
"""Failures retried with backoff; those of an outage (all but the backend's) are logged once per outage."""

CONFLICT_BACKOFF = Backoff(initial=0.1, maximum=30.0)
"""Delay before looking again at a rollout whose command the gateway refused as a conflict."""
PRUNE_AFTER_S = 60.0


class Controller(Launcher):
    """The reconcile loop (see the module docstring). `run()` until `stop()`."""

    # ---- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to stop (stop starting; commands in flight finish; executions keep running)."""
        self._stopping.set()
        self._changed.set()

    async def run(self) -> None:
        """Rebuild from the stream and the backends, then reconcile until `stop()`."""
        await self._rebuild()
        for name in self._needed_backends():
            await self._ensure_backend(name)
        self._spawn(self._follow())
        self._mark_all()
        self.started.set()
        log.info(
            "controller started: %d run(s), %d rollout(s), %d execution(s), stream position %d",
            len(self.specs),
            len(self.rollouts),
            sum(len(v) for v in self.executions.values()),
            self.high_seq,
        )
        next_resync = time.monotonic() + self.settings.resync_s
        resync: asyncio.Task[None] | None = None
        try:
            while not self._stopping.is_set():
                self._process()
                now = time.monotonic()
                if now >= next_resync and (resync is None or resync.done()):
                    resync = self._spawn(self._resync())
                    next_resync = now + self.settings.resync_s
                wait = next_resync - now
                if self._timers:
                    wait = min(wait, min(self._timers.values()) - time.time())
                self._changed.clear()
                if self._dirty:
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(wait, 0.0)):  # not wait_for: on 3.11 it can lose a cancel
                        await self._changed.wait()
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        busy = list(self._busy.values())
        if busy:
            await asyncio.wait(busy, timeout=15.0)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for backend in self.backends.values():
            with contextlib.suppress(Exception):
                await backend.close()
        log.info(
            "controller stopped (actions %s; gateway calls %s); executions keep running for the next controller",
            dict(self.stats),
            dict(self.gateway.calls),
        )

    # ---- the view --------------------------------------------------------------------------

    async def _rebuild(self) -> None:
        async for stored in self.store.read(self.filters):
            self._apply(stored)

    def _apply(self, stored: StoredEvent) -> None:
        event = stored.event
        self.high_seq = max(self.high_seq, stored.seq)
        if isinstance(event, RunStarted):
            before = self.runs.get(event.run_id)
            view = fold_run(before, stored)
            spec = run_spec(view)
            if view is None or spec is None or (before is not None and before.started_seq == view.started_seq):
                return  # a duplicate, or a later RunStarted: a run's spec never changes
            self.runs[event.run_id] = view
            self.specs[event.run_id] = spec
            if isinstance(spec, RunSpec) and spec.job_template and spec.backend == "kubernetes":
                self._templates.setdefault(backend_id(spec), (spec.job_template, spec.run_id))
            if event.run_id in self.by_run:
                self._dirty.update(self.by_run[event.run_id])
            self._changed.set()
            return
        if event.rollout_id is None:
            return
        key = RolloutKey(event.run_id, event.rollout_id)
        updated = compact(fold(self.rollouts.get(key), stored))
        if updated is None:
            return
        self.rollouts[key] = updated
        self.by_run.setdefault(key.run_id, set()).add(key)
        self._dirty.add(key)
        self._changed.set()

    async def _follow(self) -> None:
        """Apply new events as they come (a durable consumer; events already folded are no-ops)."""
        while not self._stopping.is_set():
            try:
                await self._drop_stale_durable()
                async for stored in self.store.subscribe(
                    self.filters, durable=self.settings.durable, after_seq=self.high_seq
                ):
                    self._stream_outage.ok()
                    self._apply(stored)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._stream_outage.failed(exc, "following events; resubscribing every second")
                await asyncio.sleep(1.0)

    async def _drop_stale_durable(self) -> None:
        """Recreate the durable consumer when it follows other subjects (the served runs changed)."""
        try:
            info = await self.store.js.consumer_info(self.settings.stream, self.settings.durable)
        except Exception:
            return
        config = info.config
        current = sorted(config.filter_subjects or ([config.filter_subject] if config.filter_subject else []))
        if current != sorted(self.filters):
            log.info("durable consumer %s follows %s; recreating it", self.settings.durable, current)
            with contextlib.suppress(Exception):
                await self.store.js.delete_consumer(self.settings.stream, self.settings.durable)

    # ---- backends --------------------------------------------------------------------------

    async def _resync(self) -> None:
        """The periodic full reconcile: re-list every backend, re-check statuses, look at everything."""
        for name in self._needed_backends():
            await self._ensure_backend(name)
        for name, backend in list(self.backends.items()):
            if name in self._watching:
                try:
                    await self._relist(name, backend)
                except Exception as exc:
                    log.warning("cannot list the %s backend: %s", name, exc)
        await self._verify_statuses()
        self._prune()
        self._mark_all()

    def _prune(self) -> None:
        """Forget rollouts that ended a while ago and have no execution left (memory stays bounded)."""
        cutoff = time.time() - PRUNE_AFTER_S
        for key, view in list(self.rollouts.items()):
            if view.terminal and view.status_time < cutoff and not self.executions.get(key) and key not in self._busy:
                del self.rollouts[key]
                self.by_run.get(key.run_id, set()).discard(key)
                self.executions.pop(key, None)
                self._retry_at.pop(key, None)
                self._failures.pop(key, None)
                self._awaiting.pop(key, None)

    async def _verify_statuses(self) -> None:
        """Catch what no event announced: a rollout deleted (its subjects purged) or a missed status."""
        limit = asyncio.Semaphore(16)

        async def check(key: RolloutKey, view: Rollout) -> None:
            async with limit:
                try:
                    last, seq = await self.store.last_status(key.run_id, key.rollout_id)
                except Exception as exc:
                    log.warning("cannot check rollout %s: %s", key.rollout_id, exc)
                    return
                if key not in self._busy and (last is None or seq > view.status_seq):
                    await self._safe_refresh(key)

        # Rollouts whose status changed within the last period are left out: their events are on
        # their way, and re-reading them would only race the subscription.
        settled_before = time.time() - self.settings.resync_s
        in_flight = [
            (key, view)
            for key, view in self.rollouts.items()
            if view.status in ("preparing", "running", "requeuing")
            and view.status_time < settled_before
            and key not in self._busy
            and key not in self._awaiting
        ]
        await asyncio.gather(*(check(key, view) for key, view in in_flight))

    # ---- the loop --------------------------------------------------------------------------

    def _mark_all(self) -> None:
        for key, view in self.rollouts.items():
            if not view.terminal:
                self._dirty.add(key)
        self._dirty.update(k for k, v in self.executions.items() if v)
        self._changed.set()

    def _process(self) -> None:
        now = time.time()
        for key, at in list(self._timers.items()):
            if at <= now:
                del self._timers[key]
                self._dirty.add(key)
        dirty, self._dirty = self._dirty, set()
        for key in dirty:
            self._consider(key, now)
        if not self._stopping.is_set():
            self._admit()

    def _wake(self, key: RolloutKey, at: float) -> None:
        if at < self._timers.get(key, float("inf")):
            self._timers[key] = at

    def _consider(self, key: RolloutKey, now: float) -> None:
        if key in self._busy:
            return  # its task marks it dirty again when done
        view = self.rollouts.get(key)
        execs = self.executions.get(key, {})
        if view is None:
            self._orphans(key, execs)
            return
        spec = self.specs.get(key.run_id)
        if not self._serves(spec):
            return
        retry_at = self._retry_at.get(key, 0.0)
        if retry_at > now:
            self._wake(key, retry_at)
            return
        awaiting = self._awaiting.get(key)
        if awaiting is not None:
            seq, deadline = awaiting
            if view.status_seq >= seq:
                del self._awaiting[key]
            elif now < deadline:
                self._wake(key, deadline)
                return
            else:
                self._run(key, self._refresh(key))
                return
        decision = decide(view, spec, list(execs.values()), now, kill_grace_s=self.settings.kill_grace_s)
        if decision.wake_at is not None:
            self._wake(key, decision.wake_at)
        starts = [a for a in decision.actions if isinstance(a, Start)]
        others = [a for a in decision.actions if not isinstance(a, Start)]
        queue = self._startable.setdefault(key.run_id, {})
        if starts and not others and not self._stopping.is_set():
            queue[key] = None
            return
        queue.pop(key, None)
        if others:
            self._run(key, self._act(key, others))

    def _orphans(self, key: RolloutKey, execs: dict[str, ExecutionState]) -> None:
        """Stop executions of a rollout the stream no longer has (deleted), if its run is served."""
        if not execs or not self._serves(self.specs.get(key.run_id)):
            return
        actions: list[Action] = [
            Kill(aid, "its rollout was deleted") if not ex.terminal else Forget(aid) for aid, ex in execs.items()
        ]
        self._run(key, self._act(key, actions))

    def _live_counts(self) -> tuple[Counter[str], Counter[str]]:
        by_run: Counter[str] = Counter(self._starting)
        by_backend: Counter[str] = Counter(self._starting_backend)
        for execs in self.executions.values():
            for ex in execs.values():
                if not ex.terminal:
                    by_run[ex.key.run_id] += 1
                    by_backend[self.owner.get(ex.key, "")] += 1
        return by_run, by_backend

    def _admit(self) -> None:
        """Start queued rollouts, oldest first, within each run's concurrency and each backend's capacity."""
        if not any(self._startable.values()):
            return
        by_run, by_backend = self._live_counts()
        for run_id, queue in self._startable.items():
            spec = self.specs.get(run_id)
            if not isinstance(spec, RunSpec) or not queue:
                continue
            bid = backend_id(spec)
            backend = self.backends.get(bid)
            if backend is None or bid not in self._watching:
                if self._backend_retry_at.get(bid, 0.0) <= time.monotonic():
                    self._backend_retry_at[bid] = time.monotonic() + 1.0
                    self._spawn(self._ensure_backend(bid))
                continue
            for key in list(queue):  # insertion order: oldest first
                if len(self._busy) >= self.settings.max_inflight:
                    return
                if by_run[run_id] >= spec.concurrency:
                    break
                if backend.capacity is not None and by_backend[bid] >= backend.capacity:
                    break
                del queue[key]
                if key in self._busy or key not in self.rollouts:
                    continue
                by_run[run_id] += 1
                by_backend[bid] += 1
                self._starting[run_id] += 1
                self._starting_backend[bid] += 1
                self._run(key, self._start(key, spec, bid, backend, None), starting=(run_id, bid))

    def _run(self, key: RolloutKey, coro: Any, starting: tuple[str, str] | None = None) -> None:
        task = asyncio.create_task(self._guarded(key, coro, starting))
        self._busy[key] = task

    async def _guarded(self, key: RolloutKey, coro: Any, starting: tuple[str, str] | None) -> None:
        """Run one rollout's step; sort its failure into retry-later, re-read, or record-and-wait."""
        try:
            await coro
            self._failures.pop(key, None)
            self._gateway_outage.ok()
        except GatewayConflict as exc:
            log.info("rollout %s moved on (%s); re-reading it", key.rollout_id, exc)
            await self._safe_refresh(key)
            # Should the gateway keep refusing what the view calls for, do not ask in a tight loop.
            self._retry_later(key, CONFLICT_BACKOFF.delay(self._failures[key]))
            self._failures[key] += 1
        except GatewayRejected as exc:
            if exc.status_code == 404:
                await self._safe_refresh(key)
            else:
                log.error("gateway refused a command for rollout %s: %s", key.rollout_id, exc)
                self._retry_later(key, 60.0)
        except TEMPORARY_ERRORS as exc:
            delay = getattr(exc, "retry_after", None) or UNAVAILABLE_BACKOFF.delay(self._failures[key])
            self._failures[key] += 1
            if isinstance(exc, TemporaryBackendError):
                log.warning("rollout %s: %s; retrying in %.1fs", key.rollout_id, exc, delay)
            else:  # an outage: one line for all rollouts, not one traceback each
                self._gateway_outage.failed(exc, f"rollouts are retried with backoff, first in {delay:.1f}s")
            self._retry_later(key, delay)
        except PermanentBackendError as exc:
            log.error("rollout %s: %s", key.rollout_id, exc)
            self._retry_later(key, 60.0)
        except Exception:
            log.exception("rollout %s: unexpected error; retrying in 10s", key.rollout_id)
            self._retry_later(key, 10.0)
        finally:
            if starting is not None:
                self._starting[starting[0]] -= 1
                self._starting_backend[starting[1]] -= 1
            self._busy.pop(key, None)
            self._dirty.add(key)
            self._changed.set()

    # ---- actions ---------------------------------------------------------------------------
