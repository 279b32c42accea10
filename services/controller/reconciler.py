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
import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import nats.errors

from schemas import RunStarted
from schemas.ids import ROLLOUT_ATTEMPT, ROLLOUT_CREATED, ROLLOUT_STATUS, RUN_SUBJECT
from schemas.runs import RunSpec
from services.common.eventstore import EventStore, EventStoreError, StoredEvent
from services.common.outage import Outage
from services.controller import metrics
from services.controller.backends.base import (
    ExecutionBackend,
    ExecutionKey,
    ExecutionState,
    LaunchSpec,
    PermanentBackendError,
    RolloutKey,
    TemporaryBackendError,
)
from services.controller.decide import (
    Action,
    Forget,
    Kill,
    MarkEnded,
    MarkRunning,
    Relaunch,
    Start,
    after_failure,
    decide,
    timeout_s,
)
from services.controller.gateway import (
    AttemptGrant,
    GatewayClient,
    GatewayConflict,
    GatewayRejected,
    GatewayUnavailable,
)
from services.controller.settings import ControllerSettings
from services.controller.view import NOT_LAUNCHED, Attempt, Rollout, RunSpecError, fold, spec_from_event

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

ATTEMPT_KEY = "rollwire-controller:{rollout}:{created}:{sequence}"
ECHO_TIMEOUT_S = 5.0
LOG_EVENT = "log"
LAUNCH_RETRIES = 3
PRUNE_AFTER_S = 60.0


def backend_id(spec: RunSpec) -> str:
    """Which backend instance runs the spec's rollouts: `local`, `kubernetes` (the controller's Job
    template), or `kubernetes:<digest>` for a run that brings its own `job_template` (one backend,
    with its own instance label, per distinct template)."""
    if spec.backend == "kubernetes" and spec.job_template:
        return "kubernetes:" + hashlib.sha256(spec.job_template.encode()).hexdigest()[:12]
    return spec.backend


def subjects(runs: tuple[str, ...]) -> list[str]:
    """The subjects the controller reads: run specs, and rollouts' created, attempt and status events."""
    names = runs or ("*",)
    out: list[str] = []
    for run in names:
        out += [
            RUN_SUBJECT.format(run=run),
            ROLLOUT_CREATED.format(run=run, rollout="*"),
            ROLLOUT_ATTEMPT.format(run=run, rollout="*"),
            ROLLOUT_STATUS.format(run=run, rollout="*"),
        ]
    return out


def attempt_env(rollout: Rollout, spec: RunSpec, grant: AttemptGrant) -> dict[str, str]:
    """The agent's environment: the run's `env`, then the attempt's contract (which wins)."""
    env = {
        **spec.env,
        "OPENAI_BASE_URL": grant.proxy_base_url,
        "OPENAI_API_KEY": grant.token,
        "ANTHROPIC_BASE_URL": grant.anthropic_base_url,
        "ANTHROPIC_API_KEY": grant.token,
        "ROLLWIRE_TOKEN": grant.token,
        "ROLLWIRE_EVENTS_URL": grant.events_url,
        "ROLLWIRE_RUN_ID": rollout.run_id,
        "ROLLWIRE_ROLLOUT_ID": rollout.rollout_id,
        "ROLLWIRE_ATTEMPT_ID": grant.attempt_id,
        "ROLLWIRE_ATTEMPT_SEQUENCE": str(grant.sequence),
        "ROLLWIRE_MODE": rollout.mode,
    }
    if rollout.group_id:
        env["ROLLWIRE_GROUP_ID"] = rollout.group_id
    return env


AGENT_ONLY = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")


def evaluator_env(agent: dict[str, str], token: str) -> dict[str, str]:
    """The evaluator's environment: the agent's, minus the agent's token and proxy, plus its own token."""
    env = {k: v for k, v in agent.items() if k not in AGENT_ONLY}
    env["ROLLWIRE_TOKEN"] = token
    return env


class Controller:
    """The reconcile loop (see the module docstring). `run()` until `stop()`."""

    def __init__(
        self,
        store: EventStore,
        gateway: GatewayClient,
        settings: ControllerSettings,
        backends: Mapping[str, ExecutionBackend] | None = None,
    ) -> None:
        self.store = store
        self.gateway = gateway
        self.settings = settings
        self.filters = subjects(settings.runs)
        self.backends: dict[str, ExecutionBackend] = dict(backends or {})
        self.backend_errors: dict[str, str] = {}
        self._backend_retry_at: dict[str, float] = {}
        self._watching: set[str] = set()
        self._templates: dict[str, tuple[str, str]] = {}
        self.specs: dict[str, RunSpec | RunSpecError] = {}
        self.rollouts: dict[RolloutKey, Rollout] = {}
        self.by_run: dict[str, set[RolloutKey]] = {}
        self.executions: dict[RolloutKey, dict[str, ExecutionState]] = {}
        self.owner: dict[ExecutionKey, str] = {}
        self.seen_at: dict[ExecutionKey, float] = {}
        self.high_seq = 0
        self._busy: dict[RolloutKey, asyncio.Task[None]] = {}
        self._dirty: set[RolloutKey] = set()
        self._timers: dict[RolloutKey, float] = {}
        self._awaiting: dict[RolloutKey, tuple[int, float]] = {}
        self._retry_at: dict[RolloutKey, float] = {}
        self._failures: Counter[RolloutKey] = Counter()
        self._stream_outage = Outage(log, "the event stream (NATS)")
        self._gateway_outage = Outage(log, "the gateway or the event stream")
        self._startable: dict[str, dict[RolloutKey, None]] = {}
        self._starting: Counter[str] = Counter()
        self._starting_backend: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._changed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started = asyncio.Event()
        self.stats: Counter[str] = Counter()
        metrics.watch(self.executions, self.owner)

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

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- the view --------------------------------------------------------------------------

    async def _rebuild(self) -> None:
        async for stored in self.store.read(self.filters):
            self._apply(stored)

    def _apply(self, stored: StoredEvent) -> None:
        event = stored.event
        self.high_seq = max(self.high_seq, stored.seq)
        if isinstance(event, RunStarted):
            spec = spec_from_event(event)
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
        updated = fold(self.rollouts.get(key), event, stored.seq)
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

    async def _refresh(self, key: RolloutKey) -> None:
        """Re-read one rollout from the stream (after a conflict or a missed event)."""
        filters = [
            ROLLOUT_CREATED.format(run=key.run_id, rollout=key.rollout_id),
            ROLLOUT_ATTEMPT.format(run=key.run_id, rollout=key.rollout_id),
            ROLLOUT_STATUS.format(run=key.run_id, rollout=key.rollout_id),
        ]
        view: Rollout | None = None
        async for stored in self.store.read(filters):
            view = fold(view, stored.event, stored.seq)
        self._awaiting.pop(key, None)
        if view is None:
            if self.rollouts.pop(key, None) is not None:
                log.info("rollout %s was deleted", key.rollout_id)
            self.by_run.get(key.run_id, set()).discard(key)
        else:
            self.rollouts[key] = view
        self._dirty.add(key)
        self._changed.set()

    # ---- backends --------------------------------------------------------------------------

    def _serves(self, spec: RunSpec | RunSpecError | None) -> bool:
        if spec is None:
            return False
        if isinstance(spec, RunSpecError):
            return True
        return spec.backend in self.settings.backends

    def _needed_backends(self) -> set[str]:
        needed = {"local"} & set(self.settings.backends)
        for spec in self.specs.values():
            if isinstance(spec, RunSpec) and spec.backend in self.settings.backends:
                needed.add(backend_id(spec))
        return needed

    def _make_backend(self, name: str) -> ExecutionBackend:
        """Build the backend instance `name` (see `backend_id`)."""
        if name == "local":
            from services.controller.backends.local import LocalBackend

            return LocalBackend(
                self.settings.executions_dir,
                capacity=self.settings.local_capacity,
                kill_grace_s=self.settings.local_kill_grace_s,
            )
        if name == "kubernetes":
            from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings

            return KubernetesBackend(KubernetesSettings.from_env())
        if name.startswith("kubernetes:") and name in self._templates:
            from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings

            template, run_id = self._templates[name]
            # Everything but the template comes from the ROLLWIRE_K8S_* variables, as for the default.
            base = KubernetesSettings.from_env({**os.environ, "ROLLWIRE_K8S_JOB_TEMPLATE": os.devnull})
            settings = msgspec.structs.replace(
                base,
                job_template=template,
                template_source=f"the job_template of run {run_id}",
                instance=f"{base.instance}-{name.split(':', 1)[1]}",
            )
            return KubernetesBackend(settings)
        raise PermanentBackendError(f"unknown backend {name!r}")

    async def _ensure_backend(self, name: str) -> ExecutionBackend | None:
        """The backend `name`, made, listed and watched on first use; None (logged once) if it cannot be made."""
        backend = self.backends.get(name)
        if backend is None:
            if self._backend_retry_at.get(name, 0.0) > time.monotonic():
                return None
            try:
                backend = self._make_backend(name)
            except Exception as exc:
                message = f"the {name} backend is not available: {exc}"
                if self.backend_errors.get(name) != message:
                    log.error("%s; its runs' rollouts stay queued (retrying)", message)
                self.backend_errors[name] = message
                self._backend_retry_at[name] = time.monotonic() + self.settings.resync_s
                return None
            self.backends[name] = backend
            self.backend_errors.pop(name, None)
        if name not in self._watching:
            self._watching.add(name)
            try:
                await self._relist(name, backend)
            except Exception as exc:
                log.warning("cannot list the %s backend yet: %s", name, exc)
            self._spawn(self._watch(name, backend))
        return backend

    async def _watch(self, name: str, backend: ExecutionBackend) -> None:
        while not self._stopping.is_set():
            try:
                async for state in backend.watch():
                    self._on_state(name, state)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("watching the %s backend failed (%s); watching again in 1s", name, exc)
                await asyncio.sleep(1.0)

    def _on_state(self, name: str, state: ExecutionState) -> None:
        key = state.key
        rollout_key = key.rollout
        known = self.executions.setdefault(rollout_key, {})
        self.owner[key] = name
        self.seen_at[key] = time.monotonic()
        if state.deleted:
            view = self.rollouts.get(rollout_key)
            # Keep the last word on the active attempt so its reason is reported, not "vanished".
            if view is not None and view.active_attempt_id == key.attempt_id and state.terminal:
                known[key.attempt_id] = msgspec.structs.replace(state, deleted=False)
            else:
                known.pop(key.attempt_id, None)
        else:
            known[key.attempt_id] = state
        self._dirty.add(rollout_key)
        self._changed.set()

    async def _relist(self, name: str, backend: ExecutionBackend) -> None:
        """Merge a fresh listing: update what it shows, drop what it no longer has (unless newer)."""
        began = time.monotonic()
        states = await backend.list()
        listed = {state.key for state in states}
        for state in states:
            if self.seen_at.get(state.key, 0.0) <= began:
                self._on_state(name, state)
        for key, owner in list(self.owner.items()):
            if owner == name and key not in listed and self.seen_at.get(key, 0.0) <= began:
                known = self.executions.get(key.rollout, {})
                current = known.get(key.attempt_id)
                if current is not None and not current.terminal:
                    known.pop(key.attempt_id, None)
                    self._dirty.add(key.rollout)
                self.owner.pop(key, None)
                self.seen_at.pop(key, None)

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
            self._retry_later(key, min(30.0, 0.1 * 2 ** self._failures[key]))
            self._failures[key] += 1
        except GatewayRejected as exc:
            if exc.status_code == 404:
                await self._safe_refresh(key)
            else:
                log.error("gateway refused a command for rollout %s: %s", key.rollout_id, exc)
                self._retry_later(key, 60.0)
        except TEMPORARY_ERRORS as exc:
            delay = getattr(exc, "retry_after", None) or min(30.0, 0.5 * 2 ** self._failures[key])
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

    async def _safe_refresh(self, key: RolloutKey) -> None:
        try:
            await self._refresh(key)
        except Exception as exc:
            log.warning("cannot re-read rollout %s: %s", key.rollout_id, exc)
            self._retry_later(key, 1.0)

    def _retry_later(self, key: RolloutKey, delay: float) -> None:
        self._retry_at[key] = time.time() + delay

    # ---- actions ---------------------------------------------------------------------------

    async def _act(self, key: RolloutKey, actions: Sequence[Action]) -> None:
        for action in actions:
            match action:
                case Kill(attempt_id=aid, reason=reason):
                    log.info("stopping rollout %s attempt %s: %s", key.rollout_id, aid, reason)
                    await self._cancel(key, aid)
                    self.stats["killed"] += 1
                case Forget(attempt_id=aid):
                    await self._cancel(key, aid)
                    self._logged.discard(aid)
                case MarkRunning(attempt_id=aid):
                    await self._set_status(key, "running", aid, None)
                    self._link_logs(key, aid)
                    self.stats["running"] += 1
                case MarkEnded(attempt_id=aid, status=status, reason=reason):
                    await self._set_status(key, status, aid, reason)
                    if aid is not None:
                        self._link_logs(key, aid)
                    self.stats[status] += 1
                    if status != "succeeded":
                        log.info("rollout %s attempt %s -> %s: %s", key.rollout_id, aid, status, reason)
                case Relaunch():
                    spec = self.specs.get(key.run_id)
                    if not isinstance(spec, RunSpec):
                        return
                    bid = backend_id(spec)
                    backend = await self._ensure_backend(bid)
                    if backend is None:
                        self._retry_later(key, self.settings.resync_s)
                        return
                    await self._start(key, spec, bid, backend, action)
                case Start():
                    raise AssertionError("starts are admitted by _admit")

    async def _cancel(self, key: RolloutKey, attempt_id: str) -> None:
        execution = ExecutionKey(key.run_id, key.rollout_id, attempt_id)
        backend = self.backends.get(self.owner.get(execution, ""))
        if backend is not None:
            await backend.cancel(execution)
        self.executions.get(key, {}).pop(attempt_id, None)
        self.owner.pop(execution, None)
        self.seen_at.pop(execution, None)

    async def _set_status(self, key: RolloutKey, status: str, attempt_id: str | None, reason: str | None) -> None:
        idem = f"rollwire-controller:{key.rollout_id}:{attempt_id or '-'}:{status}"
        began = time.monotonic()
        seq = await self.gateway.set_status(key.rollout_id, status, attempt_id=attempt_id, reason=reason, key=idem)
        spec = self.specs.get(key.run_id)
        backend = spec.backend if isinstance(spec, RunSpec) else "unknown"
        metrics.status_written(key.run_id, key.rollout_id, backend, status, reason)
        log.debug("rollout %s -> %s in %.0f ms", key.rollout_id, status, (time.monotonic() - began) * 1000)
        self._awaiting[key] = (seq, time.time() + ECHO_TIMEOUT_S)

    def _link_logs(self, key: RolloutKey, attempt_id: str) -> None:
        """Link the execution's logs from the rollout: a custom event `log`, once per attempt.

        Posted in the background, after the status change it accompanies, so it never delays one.
        """
        if attempt_id in self._logged:
            return
        state = self.executions.get(key, {}).get(attempt_id)
        if state is None or not state.log_location:
            return
        self._logged.add(attempt_id)
        self._spawn(self._post_log(key, attempt_id, state))

    async def _post_log(self, key: RolloutKey, attempt_id: str, state: ExecutionState) -> None:
        execution = ExecutionKey(key.run_id, key.rollout_id, attempt_id)
        body = {
            "type": "custom",
            "name": LOG_EVENT,
            "payload": {
                "attempt_id": attempt_id,
                "backend": self.owner.get(execution),
                "log_location": state.log_location,
                "execution": state.execution,
            },
        }
        try:
            await self.gateway.post_event(key.rollout_id, attempt_id, body, f"rollwire-controller:{attempt_id}:log")
        except Exception as exc:
            log.warning("could not link the logs of rollout %s attempt %s: %s", key.rollout_id, attempt_id, exc)

    async def _start(
        self, key: RolloutKey, spec: RunSpec, bid: str, backend: ExecutionBackend, relaunch: Relaunch | None
    ) -> None:
        """Start (or, after a restart, resume) an attempt and launch its execution."""
        view = self.rollouts[key]
        if spec.backend == "local" and not spec.command:
            reason = f"run {spec.run_id} sets no command: the local backend needs RunSpec.command (an argv list)"
            await self._set_status(key, "failed", view.current.attempt_id if view.current else None, reason)
            return
        sequence = relaunch.sequence if relaunch else len(view.attempts) + 1
        idem = ATTEMPT_KEY.format(rollout=key.rollout_id, created=view.created_seq, sequence=sequence)
        began = time.monotonic()
        try:
            grant = await self.gateway.start_attempt(key.rollout_id, backend.name, idem)
        except GatewayConflict:
            if relaunch is None:
                raise
            # The preparing attempt was not started under this controller's key: nobody can
            # launch it with its token, so it ends here.
            await self._refresh(key)
            view = self.rollouts.get(key, view)
            if view.status == "preparing" and view.current and view.current.attempt_id == relaunch.attempt_id:
                reason = f"attempt {relaunch.sequence} has no execution and was not started by this controller"
                await self._end(key, view, reason)
            return
        started = time.monotonic()
        self._awaiting[key] = (grant.seq, time.time() + ECHO_TIMEOUT_S)
        if relaunch is not None and grant.attempt_id != relaunch.attempt_id:
            raise GatewayConflict(f"relaunch of {relaunch.attempt_id} got attempt {grant.attempt_id}", None)
        env = attempt_env(view, spec, grant)
        eval_env = None
        if spec.evaluator_command:
            eval_env = evaluator_env(env, await self.gateway.evaluator_token(key.rollout_id, grant.attempt_id))
        launch = LaunchSpec(
            key=ExecutionKey(key.run_id, key.rollout_id, grant.attempt_id),
            env=env,
            input_json=json.dumps(view.input),
            timeout_s=timeout_s(view, spec),
            command=list(spec.command) or None,
            evaluator_command=list(spec.evaluator_command) if spec.evaluator_command else None,
            evaluator_env=eval_env,
            image=spec.image,
        )
        for attempt in range(LAUNCH_RETRIES):
            try:
                await backend.launch(launch)
                break
            except TemporaryBackendError as exc:
                if attempt == LAUNCH_RETRIES - 1:
                    raise  # still preparing with no execution: the next look relaunches it
                await asyncio.sleep(exc.retry_after)
            except PermanentBackendError as exc:
                with_attempt = _with_attempt(view, grant)
                await self._end(key, with_attempt, f"cannot launch attempt {grant.sequence}: {exc}")
                return
        self.stats["launched"] += 1
        queued = view.status_time if view.status in ("queuing", "requeuing") else None
        metrics.launched(key.run_id, key.rollout_id, bid, grant.sequence, queued)
        log.debug(
            "rollout %s attempt %s launched in %.0f ms (start attempt %.0f ms)",
            key.rollout_id,
            grant.sequence,
            (time.monotonic() - began) * 1000,
            (started - began) * 1000,
        )
        known = self.executions.setdefault(key, {}).get(grant.attempt_id)
        if known is None or (known.phase == "failed" and (known.reason or "").startswith(NOT_LAUNCHED)):
            # Until the backend's watch reports it: counted against capacity, never relaunched.
            self._on_state(bid, ExecutionState(key=launch.key, phase="pending"))

    async def _end(self, key: RolloutKey, view: Rollout, reason: str) -> None:
        step = after_failure(view, reason)
        await self._set_status(key, step.status, step.attempt_id, step.reason)


def _with_attempt(view: Rollout, grant: AttemptGrant) -> Rollout:
    """The view as it will be once the stream shows the attempt just started."""
    if any(a.attempt_id == grant.attempt_id for a in view.attempts):
        return view
    attempt = Attempt(attempt_id=grant.attempt_id, sequence=grant.sequence, started_at=time.time())
    return msgspec.structs.replace(view, attempts=(*view.attempts, attempt), status="preparing")
