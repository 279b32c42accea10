"""What the controller knows and keeps while it runs: runs, rollouts (the contract's fold), executions,
backends and the queues of its loop; and the helpers every part of it uses.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from schemas.ids import ROLLOUT_ATTEMPT, ROLLOUT_CREATED, ROLLOUT_STATUS, RUN_SUBJECT
from schemas.rollout import fold
from schemas.run import RunView
from schemas.runs import RunSpec
from services.common.eventstore import EventStore
from services.common.outage import Outage
from services.controller import metrics
from services.controller.backends.base import (
    ExecutionBackend,
    ExecutionKey,
    ExecutionState,
    RolloutKey,
)
from services.controller.gateway import (
    GatewayClient,
)
from services.controller.settings import ControllerSettings
from services.controller.view import Rollout, RunSpecError, compact

log = logging.getLogger("rollwire.controller")


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


class ControllerState:
    """The state of `Controller` (`reconciler.py`)."""

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
        self.runs: dict[str, RunView] = {}  # the contract's run fold of each run's `RunStarted`
        self.specs: dict[str, RunSpec | RunSpecError] = {}  # each run's spec, from `runs` (`view.run_spec`)
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

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _retry_later(self, key: RolloutKey, delay: float) -> None:
        self._retry_at[key] = time.time() + delay

    async def _refresh(self, key: RolloutKey) -> None:
        """Re-read one rollout from the stream (after a conflict or a missed event)."""
        filters = [
            ROLLOUT_CREATED.format(run=key.run_id, rollout=key.rollout_id),
            ROLLOUT_ATTEMPT.format(run=key.run_id, rollout=key.rollout_id),
            ROLLOUT_STATUS.format(run=key.run_id, rollout=key.rollout_id),
        ]
        view: Rollout | None = None
        async for stored in self.store.read(filters):
            view = fold(view, stored)
        view = compact(view)
        self._awaiting.pop(key, None)
        if view is None:
            if self.rollouts.pop(key, None) is not None:
                log.info("rollout %s was deleted", key.rollout_id)
            self.by_run.get(key.run_id, set()).discard(key)
        else:
            self.rollouts[key] = view
        self._dirty.add(key)
        self._changed.set()

    async def _safe_refresh(self, key: RolloutKey) -> None:
        try:
            await self._refresh(key)
        except Exception as exc:
            log.warning("cannot re-read rollout %s: %s", key.rollout_id, exc)
            self._retry_later(key, 1.0)
