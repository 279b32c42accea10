"""The controller's view of runs and rollouts: a pure fold over their events, rebuilt from the stream.

The controller keeps no state of its own. What it knows about a rollout (status, attempts, input)
is `fold`ed from the rollout's `created`, `attempt` and `status` events, and what it knows about a
run (how its rollouts execute) from the run's `RunStarted.config`. Replaying the same events
always gives the same view, so a restarted controller knows exactly what the crashed one knew.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas import AnyEvent, AttemptStarted, RolloutCreated, RolloutStatusChanged, RunStarted, is_terminal
from schemas.runs import RunSpec

NOT_LAUNCHED = "not launched: "
"""Prefix of the reason a backend gives for an execution that never started (its launcher stopped
first): the controller launches the attempt again instead of counting it as a failure."""


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt of a rollout as the stream tells it."""

    attempt_id: str
    sequence: int
    started_at: float
    reached_running: bool = False
    ended_as: str | None = None
    reason: str | None = None


class Rollout(msgspec.Struct, frozen=True, kw_only=True):
    """What the controller needs to know about one rollout, folded from its events."""

    run_id: str
    rollout_id: str
    input: Any = None
    mode: str = "train"
    group_id: str | None = None
    max_attempts: int = 1
    timeout_s: float | None = None
    created_seq: int = 0
    status: str | None = None
    status_time: float = 0.0
    status_seq: int = 0
    reason: str | None = None
    attempts: tuple[Attempt, ...] = ()
    last_seq: int = 0

    @property
    def terminal(self) -> bool:
        """True once nothing more will happen to the rollout (succeeded, failed or cancelled)."""
        return is_terminal(self.status)

    @property
    def current(self) -> Attempt | None:
        """The latest attempt, if any."""
        return self.attempts[-1] if self.attempts else None

    @property
    def active_attempt_id(self) -> str | None:
        """The attempt that should have a live execution now (preparing or running), else None."""
        if self.status in ("preparing", "running") and self.attempts:
            return self.attempts[-1].attempt_id
        return None


def _replace_attempt(attempts: tuple[Attempt, ...], attempt_id: str | None, **changes: Any) -> tuple[Attempt, ...]:
    if attempt_id is None:
        return attempts
    return tuple(msgspec.structs.replace(a, **changes) if a.attempt_id == attempt_id else a for a in attempts)


def fold(rollout: Rollout | None, event: AnyEvent, seq: int) -> Rollout | None:
    """Apply one event (at stream sequence `seq`) to a rollout's view; events already applied are no-ops."""
    if event.rollout_id is None:
        return rollout
    if rollout is not None and seq <= rollout.last_seq:
        return rollout
    if rollout is None:
        rollout = Rollout(run_id=event.run_id, rollout_id=event.rollout_id)
    match event:
        case RolloutCreated():
            return msgspec.structs.replace(
                rollout,
                input=event.input,
                mode=event.mode,
                group_id=event.group_id,
                max_attempts=event.max_attempts,
                timeout_s=_timeout_from(event.config),
                created_seq=seq,
                last_seq=seq,
            )
        case AttemptStarted():
            attempt_id = event.attempt_id or ""
            if any(a.attempt_id == attempt_id for a in rollout.attempts):
                # The gateway writes `preparing` first; this only confirms the attempt's number.
                attempts = _replace_attempt(rollout.attempts, attempt_id, sequence=event.sequence)
            else:
                attempts = (
                    *rollout.attempts,
                    Attempt(attempt_id=attempt_id, sequence=event.sequence, started_at=event.time),
                )
            return msgspec.structs.replace(rollout, attempts=attempts, last_seq=seq)
        case RolloutStatusChanged():
            attempts = rollout.attempts
            if event.attempt_id is not None and all(a.attempt_id != event.attempt_id for a in attempts):
                # A status naming an attempt not seen before (the gateway's AttemptStarted follows).
                attempts = (
                    *attempts,
                    Attempt(attempt_id=event.attempt_id, sequence=len(attempts) + 1, started_at=event.time),
                )
            if event.status == "running":
                attempts = _replace_attempt(attempts, event.attempt_id, reached_running=True)
            elif event.status in ("requeuing", "succeeded", "failed", "cancelled"):
                target = event.attempt_id or (attempts[-1].attempt_id if attempts else None)
                attempts = _replace_attempt(attempts, target, ended_as=event.status, reason=event.reason)
            keep_input = not is_terminal(event.status)
            return msgspec.structs.replace(
                rollout,
                status=event.status,
                status_time=event.time,
                status_seq=seq,
                reason=event.reason,
                attempts=attempts,
                input=rollout.input if keep_input else None,  # a finished rollout's input is never needed again
                last_seq=seq,
            )
        case _:
            return rollout


def _timeout_from(config: dict[str, Any]) -> float | None:
    """A rollout's own time limit from its config (Agent Lightning's `timeout_seconds`), if valid."""
    value = config.get("timeout_seconds", config.get("timeout_s"))
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


class RunSpecError(msgspec.Struct, frozen=True):
    """A run whose recorded config is not a valid RunSpec; the message says which field."""

    run_id: str
    message: str


def spec_from_event(event: RunStarted) -> RunSpec | RunSpecError:
    """The run's executor settings from its `RunStarted.config` (the run id comes from the envelope)."""
    try:
        return msgspec.convert({**event.config, "run_id": event.run_id}, RunSpec)
    except (msgspec.ValidationError, ValueError) as exc:
        return RunSpecError(event.run_id, f"run {event.run_id} has an invalid executor config: {exc}")
