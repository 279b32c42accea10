"""What the GET endpoints read: rollout views folded from events, behind a small protocol.

`RolloutReader` is the seam between the routes and the storage that answers queries. Until the
Postgres projection serves them, `StreamRolloutReader` folds a rollout's events straight from the
stream; a projection-backed reader implements the same four methods and the routes do not change.

The fold (`fold_rollout`) is pure: events in stream order in, one `RolloutView` out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import msgspec

from schemas import (
    AttemptStarted,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    RunStarted,
    is_terminal,
)
from schemas.ids import RUN_SUBJECT, check_id
from services.common.eventstore import EventStore, StoredEvent

# Subjects a rollout view is folded from (model requests and custom events do not change it).
VIEW_SUFFIXES = ("created", "status", "attempt", "reward")


class AttemptView(msgspec.Struct, kw_only=True):
    """One attempt of a rollout."""

    attempt_id: str
    sequence: int
    started_at: float
    executor: str | None = None
    ended: bool = False


class RewardView(msgspec.Struct, kw_only=True):
    """One reported reward."""

    value: float
    attempt_id: str | None
    name: str | None
    source: str
    time: float


class RolloutView(msgspec.Struct, kw_only=True):
    """Everything the rollout API says about one rollout."""

    rollout_id: str
    run_id: str
    input: Any = None
    group_id: str | None = None
    mode: str = "train"
    metadata: dict[str, Any] = {}
    config: dict[str, Any] = {}
    max_attempts: int = 1
    status: str = "queuing"
    previous: str | None = None
    reason: str | None = None
    attempt_id: str | None = None
    attempts: list[AttemptView] = []
    rewards: list[RewardView] = []
    succeeded_attempt: str | None = None
    version: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    created_seq: int = 0
    status_seq: int = 0
    terminal_seq: int = 0

    @property
    def reward(self) -> float | None:
        """The last reward of the succeeded attempt, else the latest reward (None when none)."""
        if self.succeeded_attempt is not None:
            for reward in reversed(self.rewards):
                if reward.attempt_id in (self.succeeded_attempt, None):
                    return reward.value
        return self.rewards[-1].value if self.rewards else None

    def attempt(self, attempt_id: str) -> AttemptView | None:
        """The attempt with this id, if the rollout has one."""
        for attempt in self.attempts:
            if attempt.attempt_id == attempt_id:
                return attempt
        return None


def _end_attempts(view: RolloutView, attempt_id: str | None = None) -> None:
    for attempt in view.attempts:
        if attempt_id is None or attempt.attempt_id == attempt_id:
            attempt.ended = True


def apply(view: RolloutView | None, stored: StoredEvent) -> RolloutView | None:
    """Fold one stored event into the view (None until the rollout's `created` event)."""
    event = stored.event
    if isinstance(event, RolloutCreated):
        if view is not None:
            return view
        return RolloutView(
            rollout_id=event.rollout_id or "",
            run_id=event.run_id,
            input=event.input,
            group_id=event.group_id,
            mode=event.mode,
            metadata=dict(event.metadata),
            config=dict(event.config),
            max_attempts=event.max_attempts,
            created_at=event.time,
            updated_at=event.time,
            created_seq=stored.seq,
        )
    if view is None or event.run_id != view.run_id:
        return view
    if isinstance(event, RolloutStatusChanged):
        view.previous, view.status, view.reason = view.status, event.status, event.reason
        view.version += 1
        view.updated_at = event.time
        view.status_seq = stored.seq
        aid = event.attempt_id or view.attempt_id
        if event.attempt_id and view.attempt(event.attempt_id) is None and not is_terminal(event.status):
            view.attempts.append(
                AttemptView(attempt_id=event.attempt_id, sequence=len(view.attempts) + 1, started_at=event.time)
            )
            _end_attempts_except(view, event.attempt_id)
            view.attempt_id = event.attempt_id
        if event.status == "requeuing" and aid:
            _end_attempts(view, aid)
        if is_terminal(event.status):
            _end_attempts(view)
            view.terminal_seq = stored.seq
            if event.status == "succeeded":
                view.succeeded_attempt = aid
    elif isinstance(event, AttemptStarted):
        aid = event.attempt_id or ""
        existing = view.attempt(aid)
        if existing is None:
            _end_attempts_except(view, aid)
            view.attempts.append(
                AttemptView(
                    attempt_id=aid,
                    sequence=event.sequence,
                    started_at=event.time,
                    executor=event.executor,
                    ended=is_terminal(view.status),
                )
            )
            view.attempt_id = aid
        else:
            existing.sequence, existing.executor = event.sequence, event.executor or existing.executor
        view.updated_at = max(view.updated_at, event.time)
    elif isinstance(event, RewardReported):
        view.rewards.append(
            RewardView(
                value=event.value, attempt_id=event.attempt_id, name=event.name, source=event.source, time=event.time
            )
        )
    return view


def _end_attempts_except(view: RolloutView, keep: str) -> None:
    for attempt in view.attempts:
        if attempt.attempt_id != keep:
            attempt.ended = True


def fold_rollout(events: Iterable[StoredEvent]) -> RolloutView | None:
    """The view of one rollout from its events in stream order (None if it was never created)."""
    view: RolloutView | None = None
    for stored in events:
        view = apply(view, stored)
    return view


class RolloutQuery(msgspec.Struct, kw_only=True):
    """Filters of `GET /api/rollouts`; `cursor` is the `created_seq` of the last item already seen."""

    run_id: str | None = None
    statuses: frozenset[str] = frozenset()
    group_id: str | None = None
    mode: str | None = None
    limit: int = 500
    cursor: int = 0


class RunView(msgspec.Struct, kw_only=True):
    """A run's spec (from `RunStarted`) and a summary of its rollouts."""

    run_id: str
    name: str
    config: dict[str, Any]
    started_at: float | None
    """None for a run with events that was never declared (`POST /api/runs`)."""
    seq: int
    rollouts: dict[str, int] = {}


class RolloutReader(Protocol):
    """Queries the rollout API answers; a stream fold now, a Postgres projection later."""

    async def get(self, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
        """One rollout, or None when it does not exist."""
        ...

    async def query(self, query: RolloutQuery) -> list[RolloutView]:
        """Rollouts matching the query, in creation order, after `query.cursor`, at most `limit`."""
        ...

    async def terminal(self, after: int, limit: int) -> tuple[list[RolloutView], int]:
        """Terminal rollouts in completion order from index `after`, and the total count."""
        ...

    async def events(self, rollout_id: str, run_id: str) -> list[StoredEvent]:
        """Every event of one rollout in stream order."""
        ...

    async def run(self, run_id: str) -> RunView | None:
        """A run's spec and summary, or None when no run was started with this id."""
        ...


class StreamRolloutReader:
    """`RolloutReader` that folds events from the stream on every query (no state of its own)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store

    async def get(self, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
        check_id("rollout_id", rollout_id)
        run = check_id("run_id", run_id) if run_id else "*"
        subjects = [f"rl.{run}.rollout.{rollout_id}.{suffix}" for suffix in VIEW_SUFFIXES]
        return fold_rollout([stored async for stored in self.store.read(subjects)])

    async def _fold_all(self, run_id: str | None) -> list[RolloutView]:
        run = check_id("run_id", run_id) if run_id else "*"
        filters = [f"rl.{run}.rollout.*.{suffix}" for suffix in VIEW_SUFFIXES]
        views: dict[tuple[str, str], RolloutView | None] = {}
        async for stored in self.store.read(filters):
            key = (stored.event.run_id, stored.event.rollout_id or "")
            views[key] = apply(views.get(key), stored)
        return sorted((v for v in views.values() if v is not None), key=lambda v: v.created_seq)

    async def query(self, query: RolloutQuery) -> list[RolloutView]:
        out: list[RolloutView] = []
        for view in await self._fold_all(query.run_id):
            if view.created_seq <= query.cursor:
                continue
            if query.statuses and view.status not in query.statuses:
                continue
            if query.group_id is not None and view.group_id != query.group_id:
                continue
            if query.mode is not None and view.mode != query.mode:
                continue
            out.append(view)
            if len(out) >= query.limit:
                break
        return out

    async def terminal(self, after: int, limit: int) -> tuple[list[RolloutView], int]:
        done = sorted((v for v in await self._fold_all(None) if v.terminal_seq), key=lambda v: v.terminal_seq)
        return done[after : after + limit], len(done)

    async def events(self, rollout_id: str, run_id: str) -> list[StoredEvent]:
        return await self.store.read_rollout(run_id, rollout_id)

    async def run(self, run_id: str) -> RunView | None:
        check_id("run_id", run_id)
        started: tuple[RunStarted, int] | None = None
        async for stored in self.store.read(RUN_SUBJECT.format(run=run_id)):
            if isinstance(stored.event, RunStarted) and started is None:
                started = (stored.event, stored.seq)
        counts: dict[str, int] = {}
        for view in await self._fold_all(run_id):
            counts[view.status] = counts.get(view.status, 0) + 1
        if started is None:  # rollouts without a declared run still make a run
            if not counts:
                return None
            return RunView(run_id=run_id, name="", config={}, started_at=None, seq=0, rollouts=counts)
        event, seq = started
        return RunView(
            run_id=run_id, name=event.name, config=dict(event.config), started_at=event.time, seq=seq, rollouts=counts
        )
