"""The gateway's in-memory picture of what it must check on every call, kept fresh from the stream.

The proxy must not read the stream per call, so the gateway caches, per rollout, the fold of its
`created`, `status` and `attempt` events (an LRU bounded by bytes), plus the registered models, the
last phase of each run and each run's spec. One JetStream consumer over those subjects applies
every new event in stream order; an entry only takes events newer than the last one it folded,
so a cache entry loaded from the stream and the live feed never double-apply. A miss (or an
attempt the entry does not know yet) falls back to reading the rollout's subjects once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec

from schemas import (
    AttemptStarted,
    RolloutCreated,
    RolloutStatusChanged,
    check_id,
)
from schemas.rollout import RolloutView, fold
from schemas.run import ModelView, PhaseView, RunView
from schemas.run import fold as run_fold
from schemas.runs import RunSpec
from services.common.bytecache import ByteLRU
from services.common.eventstore import EventStore, StoredEvent
from services.gateway.errors import ApiError

log = logging.getLogger("rollwire.gateway")

ROLLOUT_PATTERNS = ("rl.*.rollout.*.created", "rl.*.rollout.*.status", "rl.*.rollout.*.attempt")
REGISTRY_PATTERNS = ("rl.*.model.*", "rl.*.phase", "rl.*.run")


def _cached_size(view: RolloutView) -> int:
    """Bytes a cached view takes, as its JSON (metadata and config are the client's to size)."""
    return len(_size_encoder.encode(view))


_size_encoder = msgspec.json.Encoder()


ModelEntry = ModelView
"""A registered inference endpoint (the contract's run fold's view of one model name)."""


class GatewayState:
    """Rollout admission cache and registries (see the module docstring)."""

    def __init__(self, store: EventStore, *, cache_bytes: int = 256 * 1024 * 1024) -> None:
        self.store = store
        self.rollouts: ByteLRU[str, RolloutView] = ByteLRU(cache_bytes, _cached_size)  # without their input
        self.runs: dict[str, RunView] = {}  # the contract's run fold (`schemas.run`), per run
        self._defaults: dict[str, RunSpec] = {}
        self._listeners: list[Any] = []
        self._task: asyncio.Task[None] | None = None
        self._loads: dict[str, asyncio.Future[RolloutView | None]] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the registries, then follow new events (from the sequence the load started at)."""
        last = await self.store.last_sequence()
        async for stored in self.store.read(list(REGISTRY_PATTERNS)):
            self._apply_registry(stored)
        self._task = asyncio.create_task(self._follow(last), name="rollwire-gateway-follow")

    async def stop(self) -> None:
        """Stop following the stream."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def on_event(self, listener: Any) -> None:
        """Call `listener(stored)` for every registry event applied (the phase gate listens)."""
        self._listeners.append(listener)

    async def _follow(self, after_seq: int) -> None:
        while True:
            try:
                async for stored in self.store.subscribe([*ROLLOUT_PATTERNS, *REGISTRY_PATTERNS], after_seq=after_seq):
                    after_seq = stored.seq
                    self.apply(stored)
            except asyncio.CancelledError:
                raise
            except Exception:  # the connection dropped or the consumer vanished: resubscribe
                await asyncio.sleep(0.5)

    # ---- applying events -------------------------------------------------------------------

    def apply(self, stored: StoredEvent) -> None:
        """Apply one event from the live feed (or from our own write) to the cache and registries."""
        event = stored.event
        if isinstance(event, (RolloutCreated, RolloutStatusChanged, AttemptStarted)):
            rollout_id = event.rollout_id or ""
            cached = self.rollouts.get(rollout_id)
            if cached is not None:
                folded = fold(cached, stored)  # an event already folded, or of another run, changes nothing
                if folded is not cached:
                    self.rollouts.put(rollout_id, folded)
        else:
            self._apply_registry(stored)

    def _apply_registry(self, stored: StoredEvent) -> None:
        before = self.runs.get(stored.event.run_id)
        view = run_fold(before, stored)
        if view is None or view is before:
            return
        self.runs[view.run_id] = view
        if view.spec_error is not None and (before is None or before.spec_error is None):
            log.error("%s; its calls and rollouts are refused", view.spec_error)
        for listener in self._listeners:
            listener(stored)

    # ---- rollouts --------------------------------------------------------------------------

    def cached(self, rollout_id: str) -> RolloutView | None:
        """The cached view of a rollout, if any (no I/O)."""
        return self.rollouts.get(rollout_id)

    async def rollout(self, rollout_id: str, run_id: str | None = None, *, refresh: bool = False) -> RolloutView | None:
        """The rollout's admission view: from the cache, else (or with `refresh`) read from the stream."""
        if not refresh:
            view = self.cached(rollout_id)
            if view is not None:
                return view
        pending = self._loads.get(rollout_id)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._loads[rollout_id] = pending
            try:
                pending.set_result(await self._load(rollout_id, run_id))
            except BaseException as exc:
                pending.set_exception(exc)
                pending.exception()  # mark retrieved: concurrent waiters re-raise it themselves
                raise
            finally:
                self._loads.pop(rollout_id, None)
        return await asyncio.shield(pending)

    async def locate(self, rollout_id: str) -> str | None:
        """The run a rollout belongs to (rollout ids are unique across runs), or None if it does not exist."""
        cached = self.rollouts.get(rollout_id)
        if cached is not None:
            return cached.run_id
        created = await self.store.last(f"rl.*.rollout.{check_id('rollout_id', rollout_id)}.created")
        return created.event.run_id if created is not None else None

    async def _load(self, rollout_id: str, run_id: str | None) -> RolloutView | None:
        check_id("rollout_id", rollout_id)
        run = run_id or await self.locate(rollout_id)
        if run is None:
            return None
        view: RolloutView | None = None
        async for stored in self.store.read(
            [f"rl.{run}.rollout.{rollout_id}.{s}" for s in ("created", "status", "attempt")]
        ):
            view = fold(view, stored)
        if view is None:
            return None
        view = msgspec.structs.replace(view, input=None)  # admission never needs the task input: a small cache
        current = self.rollouts.get(rollout_id)
        if current is None or current.last_seq <= view.last_seq:
            self.rollouts.put(rollout_id, view)
            current = view
        return current

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout from the cache (after it was deleted, or to force a re-read)."""
        self.rollouts.pop(rollout_id)

    # ---- registries ------------------------------------------------------------------------

    @property
    def models(self) -> dict[tuple[str, str], ModelView]:
        """Every live registered endpoint, by (run, name)."""
        return {(m.run_id, m.name): m for view in self.runs.values() for m in view.live_models()}

    def models_for(self, run_id: str, default_run: str) -> list[ModelView]:
        """Endpoints registered for the run, else those registered without a run."""
        for run in (run_id, default_run):
            view = self.runs.get(run)
            own = view.live_models() if view is not None else []
            if own:
                return own
        return []

    def phase(self, run_id: str) -> PhaseView | None:
        """The run's last phase (None: never switched)."""
        view = self.runs.get(run_id)
        return view.phase if view is not None else None

    def spec(self, run_id: str) -> RunSpec:
        """The run's spec: each call is checked against its limits, budget and prompt mode, routed by its
        aliases and agent models. A run never started gets every default; a run whose stored spec is
        invalid is refused (409), never defaulted."""
        view = self.runs.get(run_id)
        if view is not None and view.spec is not None:
            return view.spec
        if view is not None and view.spec_error is not None:
            raise ApiError(409, view.spec_error)
        spec = self._defaults.get(run_id)
        if spec is None:
            spec = self._defaults[run_id] = RunSpec(run_id=run_id)
        return spec

    def model_alias(self, run_id: str, requested: Any) -> Any:
        """The registered model name a requested name stands for in this run (itself if no alias)."""
        if isinstance(requested, str):
            return self.spec(run_id).model_aliases.get(requested, requested)
        return requested

    def reward_from(self, run_id: str) -> str:
        """Whose rewards count in this run: `agent` (default) or `evaluator`."""
        return self.spec(run_id).reward_from
