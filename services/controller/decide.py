"""What to do about one rollout: a pure function from (rollout view, run spec, executions, now) to actions.

This is the controller's whole policy, with no I/O, so it can be tested line by line. It is
level-triggered: it compares what the stream says the rollout is with what the backend says its
executions are, and returns the actions that move one toward the other. Called again once the
actions took effect (and their events came back), it yields the next step, never a repeat.

    status      execution of the active attempt      actions
    queuing     -                                    start an attempt (when capacity allows)
    requeuing   -                                    after the backoff: start an attempt, or fail
                                                     when max_attempts are used up
    preparing   none, or never started               launch it (the same attempt: see `Relaunch`)
    preparing   pending                              wait (until the deadline)
    preparing   running / succeeded                  report running
    preparing   failed                               report the failure (retry or fail)
    running     none                                 report that it vanished (retry or fail)
    running     pending / running                    wait; kill once past the deadline
    running     succeeded / failed                   report succeeded, or the failure
    terminal    live                                 kill (the rollout was cancelled or failed)
    any         live, of another attempt             kill (a superseded attempt)
    any         ended, of a settled attempt          forget (the backend may clean it up)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from schemas import FailureCause
from schemas.runs import RunSpec
from services.controller.backends.base import ExecutionState
from services.controller.view import NOT_LAUNCHED, Rollout, RunSpecError

MAX_BACKOFF_S = 300.0
MAX_REASON_CHARS = 4000


class Start(msgspec.Struct, frozen=True, tag=True):
    """Start the rollout's next attempt and launch its execution."""


class Relaunch(msgspec.Struct, frozen=True, tag=True):
    """Launch the execution of an attempt that is `preparing` but has none.

    That happens when a controller stopped between starting the attempt and launching it. The
    attempt was started with a deterministic idempotency key (rollout id and attempt sequence), so
    asking the gateway again returns the same attempt and token, and the launch is idempotent per
    attempt: the attempt runs once, and no attempt is used up by the controller's restart.
    """

    attempt_id: str
    sequence: int


class MarkRunning(msgspec.Struct, frozen=True, tag=True):
    """Report that the attempt's execution runs."""

    attempt_id: str


class MarkEnded(msgspec.Struct, frozen=True, tag=True):
    """Report the attempt's end: `succeeded`, `requeuing` (to retry) or `failed`."""

    attempt_id: str | None
    status: Literal["succeeded", "requeuing", "failed"]
    reason: str | None = None
    cause: FailureCause | None = None


class Kill(msgspec.Struct, frozen=True, tag=True):
    """Stop an execution (timeout, cancellation, superseded attempt)."""

    attempt_id: str
    reason: str


class Forget(msgspec.Struct, frozen=True, tag=True):
    """The attempt's end is recorded: the backend may delete the finished execution."""

    attempt_id: str


Action = Start | Relaunch | MarkRunning | MarkEnded | Kill | Forget


class Decision(msgspec.Struct, frozen=True):
    """The actions to take now, and when to look at the rollout again even if nothing happens."""

    actions: tuple[Action, ...] = ()
    wake_at: float | None = None


def timeout_s(rollout: Rollout, spec: RunSpec) -> float:
    """The rollout's time limit: its own (`RolloutCreated.config.timeout_seconds`), else the run's."""
    return rollout.timeout_s if rollout.timeout_s is not None else spec.timeout_s


def backoff_s(spec: RunSpec, failures: int) -> float:
    """Delay before the retry that follows `failures` failed attempts: doubling from `retry_backoff_s`."""
    if failures <= 0 or spec.retry_backoff_s <= 0:
        return 0.0
    return float(min(spec.retry_backoff_s * 2 ** (failures - 1), MAX_BACKOFF_S))


def after_failure(rollout: Rollout, reason: str, cause: FailureCause | None) -> MarkEnded:
    """Retry (`requeuing`) or give up (`failed`, with the last reason and its cause) after the active
    attempt failed.

    The limit is the rollout's `max_attempts`, which the gateway filled from the run's spec when
    the rollout did not set its own, and which it enforces when an attempt starts.
    """
    attempt_id = rollout.current.attempt_id if rollout.current else None
    if len(rollout.attempts) < rollout.max_attempts:
        return MarkEnded(attempt_id, "requeuing", reason, cause)
    return MarkEnded(attempt_id, "failed", _gave_up(rollout, reason), cause)


def _gave_up(rollout: Rollout, reason: str) -> str:
    return f"{reason} (gave up after {len(rollout.attempts)} of {rollout.max_attempts} attempt(s))"


def failure_reason(ex: ExecutionState) -> str:
    """The reason a person reads for a failed execution: the backend's words and the log's last lines."""
    if ex.reason:
        reason = ex.reason
    elif ex.exit_code:
        reason = f"the execution failed with exit code {ex.exit_code}"
    else:
        reason = "the execution failed"
    tail = (ex.log_tail or "").strip()
    if tail and tail not in reason:
        reason = f"{reason}\nlast lines of the log:\n{tail}"
    return reason[-MAX_REASON_CHARS:]


def _cleanup(rollout: Rollout, executions: Sequence[ExecutionState], active: str | None) -> list[Action]:
    """Kill live executions that should not run; forget ended ones whose attempt is settled."""
    actions: list[Action] = []
    settled = {a.attempt_id for a in rollout.attempts if a.ended_as is not None}
    for ex in executions:
        attempt_id = ex.key.attempt_id
        if attempt_id == active:
            continue
        if not ex.terminal:
            why = f"the rollout is {rollout.status}" if rollout.terminal else "its attempt is no longer current"
            actions.append(Kill(attempt_id, why))
        elif rollout.terminal or attempt_id in settled:
            actions.append(Forget(attempt_id))
    return actions


def decide(
    rollout: Rollout,
    spec: RunSpec | RunSpecError | None,
    executions: Sequence[ExecutionState],
    now: float,
    *,
    kill_grace_s: float = 30.0,
) -> Decision:
    """The next actions for `rollout` given its executions (see the table in the module docstring).

    `kill_grace_s` is how long past its timeout an execution may still run before the controller
    stops it itself (backends enforce the timeout on their own; this is the backstop).
    """
    active = rollout.active_attempt_id
    actions = _cleanup(rollout, executions, active)
    if rollout.terminal or rollout.status_seq == 0 or spec is None:
        return Decision(tuple(actions))  # without a spec, wait: the run's RunStarted may still come
    if isinstance(spec, RunSpecError):
        if rollout.status in ("queuing", "requeuing"):
            last = rollout.current.attempt_id if rollout.current else None
            actions.append(MarkEnded(last, "failed", spec.message, "infrastructure"))
        return Decision(tuple(actions))
    if rollout.status == "queuing":
        return Decision((*actions, Start()))
    if rollout.status == "requeuing":
        return _decide_requeuing(rollout, spec, actions, now)
    current_attempt = rollout.current
    assert active is not None and current_attempt is not None
    current = next((ex for ex in executions if ex.key.attempt_id == active), None)
    never_started = (
        current is not None and current.phase == "failed" and (current.reason or "").startswith(NOT_LAUNCHED)
    )
    if rollout.status == "preparing" and (current is None or never_started):
        return Decision((*actions, Relaunch(active, current_attempt.sequence)))
    if current is None:
        reason = (
            f"the execution of attempt {current_attempt.sequence} disappeared (deleted outside the controller, "
            "or its node or process was lost)"
        )
        return Decision((*actions, after_failure(rollout, reason, "infrastructure")))
    if current.phase == "succeeded":
        step = MarkRunning(active) if rollout.status == "preparing" else MarkEnded(active, "succeeded", None)
        return Decision((*actions, step))
    if current.phase == "failed":
        return Decision((*actions, after_failure(rollout, failure_reason(current), current.cause)))
    if current.phase == "running" and rollout.status == "preparing":
        actions.append(MarkRunning(active))
    limit = timeout_s(rollout, spec)
    deadline = current_attempt.started_at + limit + kill_grace_s
    if now >= deadline:
        reason = f"timed out after {limit:g}s (stopped by the controller)"
        return Decision((*actions, Kill(active, reason), after_failure(rollout, reason, "timeout")))
    return Decision(tuple(actions), wake_at=deadline)


def _decide_requeuing(rollout: Rollout, spec: RunSpec, actions: list[Action], now: float) -> Decision:
    if len(rollout.attempts) >= rollout.max_attempts:
        last = rollout.current.attempt_id if rollout.current else None
        reason = _gave_up(rollout, rollout.reason or "the last attempt failed")
        return Decision((*actions, MarkEnded(last, "failed", reason, rollout.cause)))
    ready_at = rollout.status_time + backoff_s(spec, len(rollout.attempts))
    if now < ready_at:
        return Decision(tuple(actions), wake_at=ready_at)
    return Decision((*actions, Start()))
