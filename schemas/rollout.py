"""What the events mean for one rollout: its state as a pure fold over its stored events.

    state = None
    for stored in store.read(rollout_subjects):   # created, status, attempt, reward (any order of kinds)
        state = fold(state, stored)                # None until the rollout's `created` event

Every service that needs a rollout's state uses this one fold: the gateway's admission checks
and write answers, the projector's read models, the controller's decisions. The state is frozen;
`fold` returns a new one (or the same object when the event changes nothing). An event at a stream
sequence already folded is a no-op, so replaying a stream over a state, or feeding a live
subscription that overlaps a read, never applies an event twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, overload

import msgspec

from schemas.events import (
    AnyEvent,
    AttemptStarted,
    FailureCause,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
)
from schemas.transitions import is_terminal

_ENDING = ("requeuing", "succeeded", "failed", "cancelled")


class Sequenced(Protocol):
    """An event with its stream sequence (the event store's `StoredEvent` is one)."""

    @property
    def seq(self) -> int: ...

    @property
    def event(self) -> AnyEvent: ...


class AttemptView(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt of a rollout: when it began, whether it reached `running`, how it ended.

    `ended` is also true for an attempt a newer one replaced; `ended_as` is the status that ended
    it (requeuing, succeeded, failed, cancelled) when a status event named it.
    """

    attempt_id: str
    sequence: int
    started_at: float
    executor: str | None = None
    ended: bool = False
    reached_running: bool = False
    ended_as: str | None = None
    reason: str | None = None


class RewardView(msgspec.Struct, frozen=True, kw_only=True):
    """One reported reward."""

    value: float
    attempt_id: str | None
    name: str | None
    source: str
    time: float


class RolloutView(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout's state: its declaration, status, attempts and rewards, and where they are in the stream."""

    rollout_id: str
    run_id: str
    input: Any = None
    group_id: str | None = None
    mode: str = "train"
    metadata: dict[str, Any] = {}
    config: dict[str, Any] = {}
    max_attempts: int = 1
    status: str = "queuing"  # a created rollout is queued by the status event written with it
    previous: str | None = None
    reason: str | None = None
    cause: FailureCause | None = None
    """The last status event's `cause` (the controller's classification of a failure)."""
    attempt_id: str | None = None
    attempts: tuple[AttemptView, ...] = ()
    rewards: tuple[RewardView, ...] = ()
    succeeded_attempt: str | None = None
    version: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    status_time: float = 0.0
    created_seq: int = 0
    status_seq: int = 0
    terminal_seq: int = 0
    last_seq: int = 0

    @property
    def reward(self) -> float | None:
        """The last reward of the succeeded attempt, else the latest reward (None when none)."""
        if self.succeeded_attempt is not None:
            for reward in reversed(self.rewards):
                if reward.attempt_id in (self.succeeded_attempt, None):
                    return reward.value
        return self.rewards[-1].value if self.rewards else None

    @property
    def terminal(self) -> bool:
        """True once nothing more will happen to the rollout (succeeded, failed or cancelled)."""
        return is_terminal(self.status)

    @property
    def current(self) -> AttemptView | None:
        """The latest attempt, if any."""
        return self.attempts[-1] if self.attempts else None

    @property
    def active_attempt_id(self) -> str | None:
        """The attempt that should have a live execution now (preparing or running), else None."""
        if self.status in ("preparing", "running") and self.attempts:
            return self.attempts[-1].attempt_id
        return None

    @property
    def timeout_s(self) -> float | None:
        """The rollout's own time limit from its config (Agent Lightning's `timeout_seconds`), if valid."""
        value = self.config.get("timeout_seconds", self.config.get("timeout_s"))
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
        return None

    def attempt(self, attempt_id: str) -> AttemptView | None:
        """The attempt with this id, if the rollout has one."""
        for attempt in self.attempts:
            if attempt.attempt_id == attempt_id:
                return attempt
        return None


@overload
def fold(state: RolloutView, stored: Sequenced) -> RolloutView: ...


@overload
def fold(state: RolloutView | None, stored: Sequenced) -> RolloutView | None: ...


def fold(state: RolloutView | None, stored: Sequenced) -> RolloutView | None:
    """The rollout's state after one stored event (None until its `created` event).

    Events of other runs, events without a rollout and events at or before `state.last_seq` leave
    the state as it is; model calls and custom events do not change it.
    """
    event, seq = stored.event, stored.seq
    if state is None:
        return _created(event, seq) if isinstance(event, RolloutCreated) else None
    if seq <= state.last_seq or event.run_id != state.run_id or event.rollout_id != state.rollout_id:
        return state
    match event:
        case RolloutStatusChanged():
            return _status(state, event, seq)
        case AttemptStarted():
            return _attempt_started(state, event, seq)
        case RewardReported():
            reward = RewardView(
                value=event.value, attempt_id=event.attempt_id, name=event.name, source=event.source, time=event.time
            )
            return msgspec.structs.replace(state, rewards=(*state.rewards, reward), last_seq=seq)
        case _:
            return state


def fold_all(events: Iterable[Sequenced]) -> RolloutView | None:
    """The state after every event of an iterable of stored events, in stream order."""
    state: RolloutView | None = None
    for stored in events:
        state = fold(state, stored)
    return state


def _created(event: RolloutCreated, seq: int) -> RolloutView:
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
        created_seq=seq,
        last_seq=seq,
    )


def _end(attempts: tuple[AttemptView, ...]) -> tuple[AttemptView, ...]:
    """Every attempt marked ended."""
    return tuple(a if a.ended else msgspec.structs.replace(a, ended=True) for a in attempts)


def _change(attempts: tuple[AttemptView, ...], attempt_id: str | None, **changes: Any) -> tuple[AttemptView, ...]:
    return tuple(msgspec.structs.replace(a, **changes) if a.attempt_id == attempt_id else a for a in attempts)


def _status(state: RolloutView, event: RolloutStatusChanged, seq: int) -> RolloutView:
    attempts, current = state.attempts, state.attempt_id
    if event.attempt_id is not None and state.attempt(event.attempt_id) is None:
        # A status naming an attempt not seen before (its AttemptStarted follows).
        new = AttemptView(attempt_id=event.attempt_id, sequence=len(attempts) + 1, started_at=event.time)
        attempts, current = (*_end(attempts), new), event.attempt_id
    target = event.attempt_id or current or (attempts[-1].attempt_id if attempts else None)
    if event.status == "running":
        attempts = _change(attempts, target, reached_running=True)
    elif event.status in _ENDING:
        attempts = _change(attempts, target, ended=True, ended_as=event.status, reason=event.reason)
    terminal = is_terminal(event.status)
    if terminal:
        attempts = _end(attempts)
    return msgspec.structs.replace(
        state,
        status=event.status,
        previous=state.status,
        reason=event.reason,
        cause=event.cause,
        attempt_id=current,
        attempts=attempts,
        version=state.version + 1,
        updated_at=event.time,
        status_time=event.time,
        status_seq=seq,
        terminal_seq=seq if terminal else state.terminal_seq,
        succeeded_attempt=target if event.status == "succeeded" else state.succeeded_attempt,
        last_seq=seq,
    )


def _attempt_started(state: RolloutView, event: AttemptStarted, seq: int) -> RolloutView:
    attempt_id = event.attempt_id or ""
    existing = state.attempt(attempt_id)
    current: str | None
    if existing is None:
        new = AttemptView(
            attempt_id=attempt_id,
            sequence=event.sequence,
            started_at=event.time,
            executor=event.executor,
            ended=state.terminal,
        )
        attempts, current = (*_end(state.attempts), new), attempt_id
    else:
        # The gateway writes the attempt's first status first; this confirms its number and executor.
        executor = event.executor or existing.executor
        attempts = _change(state.attempts, attempt_id, sequence=event.sequence, executor=executor)
        current = state.attempt_id
    return msgspec.structs.replace(
        state, attempts=attempts, attempt_id=current, updated_at=max(state.updated_at, event.time), last_seq=seq
    )
