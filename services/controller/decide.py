"""What to do about one rollout: a pure function from (rollout view, run spec, executions, now) to actions.

This is the controller's whole policy, with no I/O, so it can be tested line by line. It is
level-triggered: it looks at what the stream says the rollout is and what the backend says its
executions are, and returns the actions that move one toward the other. Calling it again after
the actions took effect (and their events came back) yields the next step, never a repeat.

    status      execution of the active attempt      actions
    queuing     -                                    start an attempt (when capacity allows)
    requeuing   -                                    after the backoff: start an attempt, or fail
                                                     when max_attempts are used up
    preparing   none                                 give the attempt up as not launched (retry)
    preparing   pending                              wait (until the deadline)
    preparing   running / ended ok                   report running
    preparing   ended badly                          report the failure (retry or fail)
    running     none                                 report it vanished (retry or fail)
    running     pending / running                    wait; kill once past the deadline
    running     ended                                report succeeded, or the failure
    terminal    live                                 kill (the rollout was cancelled or failed)
    any         live, of another attempt             kill (a superseded attempt)
    any         ended, of a settled attempt          forget (let the backend clean up)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from schemas.runs import RunSpec
from services.controller.backends.base import ExecutionState
from services.controller.view import NOT_LAUNCHED, Rollout, RunSpecError

UNCHARGED_ALLOWANCE = 3
"""Attempts given up before launch do not count, but at most this many extra attempts are made."""

MAX_BACKOFF_S = 300.0
MAX_REASON_CHARS = 4000


class Start(msgspec.Struct, frozen=True, tag=True):
    """Start a new attempt and launch its execution."""


class MarkRunning(msgspec.Struct, frozen=True, tag=True):
    """Report that the attempt's execution runs."""

    attempt_id: str


class MarkEnded(msgspec.Struct, frozen=True, tag=True):
    """Report the attempt's end: `succeeded`, `requeuing` (to retry) or `failed`."""

    attempt_id: str | None
    status: Literal["succeeded", "requeuing", "failed"]
    reason: str | None = None


class Kill(msgspec.Struct, frozen=True, tag=True):
    """Stop an execution (timeout, cancellation, superseded attempt)."""

    attempt_id: str
    reason: str


class Forget(msgspec.Struct, frozen=True, tag=True):
    """The attempt's end is recorded: the backend may clean the finished execution up."""

    attempt_id: str


Action = Start | MarkRunning | MarkEnded | Kill | Forget


class Decision(msgspec.Struct, frozen=True):
    """The actions to take now, and when to look at the rollout again even if nothing happens."""

    actions: tuple[Action, ...] = ()
    wake_at: float | None = None


def timeout_s(rollout: Rollout, spec: RunSpec) -> float:
    """The rollout's time limit: its own (`RolloutCreated.config.timeout_seconds`), else the run's."""
    return rollout.timeout_s if rollout.timeout_s is not None else spec.timeout_s


def allowed_attempts(rollout: Rollout, spec: RunSpec) -> int:
    """The rollout's attempt limit: its own `max_attempts`, raised to the run's if that is higher."""
    return max(rollout.max_attempts, spec.max_attempts)


def backoff_s(spec: RunSpec, failures: int) -> float:
    """Delay before retrying after `failures` charged failures: doubling from `retry_backoff_s`."""
    if failures <= 0 or spec.retry_backoff_s <= 0:
        return 0.0
    return float(min(spec.retry_backoff_s * 2 ** (failures - 1), MAX_BACKOFF_S))


def after_failure(rollout: Rollout, spec: RunSpec, reason: str, *, charged: bool = True) -> MarkEnded:
    """Retry (`requeuing`) or give up (`failed`) after the active attempt failed with `reason`."""
    current = rollout.current
    previous = [a for a in rollout.attempts if a is not current]
    used = sum(1 for a in previous if a.charged) + (1 if charged else 0)
    limit = allowed_attempts(rollout, spec)
    attempt_id = current.attempt_id if current else None
    if used < limit and len(rollout.attempts) < limit + UNCHARGED_ALLOWANCE:
        return MarkEnded(attempt_id, "requeuing", reason)
    return MarkEnded(attempt_id, "failed", f"{reason} (gave up after {len(rollout.attempts)} attempt(s))")


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


def failure_reason(ex: ExecutionState) -> str:
    """The reason a person reads for a failed execution: the backend's words and the log's last lines."""
    reason = ex.reason or (
        f"the execution failed with exit code {ex.exit_code}" if ex.exit_code else "the execution failed"
    )
    tail = (ex.log_tail or "").strip()
    if tail and tail not in reason:
        reason = f"{reason}\nlast lines of the log:\n{tail}"
    return reason[-MAX_REASON_CHARS:]


def decide(
    rollout: Rollout,
    spec: RunSpec | RunSpecError | None,
    executions: Sequence[ExecutionState],
    now: float,
    *,
    kill_grace_s: float = 30.0,
) -> Decision:
    """The next actions for `rollout` given its executions (see the table in the module docstring)."""
    active = rollout.active_attempt_id
    actions = _cleanup(rollout, executions, active)
    if rollout.terminal or rollout.status is None:
        return Decision(tuple(actions))
    if spec is None:
        return Decision(tuple(actions))  # no run spec yet: the run's RunStarted may still come
    if isinstance(spec, RunSpecError):
        if rollout.status in ("queuing", "requeuing"):
            last = rollout.current.attempt_id if rollout.current else None
            actions.append(MarkEnded(last, "failed", spec.message))
        return Decision(tuple(actions))
    if rollout.status == "queuing":
        return Decision((*actions, Start()))
    if rollout.status == "requeuing":
        return _decide_requeuing(rollout, spec, actions, now)
    assert active is not None and rollout.current is not None
    current = next((ex for ex in executions if ex.key.attempt_id == active), None)
    if current is None:
        return Decision((*actions, _vanished(rollout, spec)))
    if current.terminal:
        if current.phase == "succeeded":
            step: Action = (
                MarkRunning(active) if rollout.status == "preparing" else MarkEnded(active, "succeeded", None)
            )
            return Decision((*actions, step))
        reason = failure_reason(current)
        return Decision((*actions, after_failure(rollout, spec, reason, charged=not reason.startswith(NOT_LAUNCHED))))
    if current.phase == "running" and rollout.status == "preparing":
        actions.append(MarkRunning(active))
    deadline = rollout.current.started_at + timeout_s(rollout, spec) + kill_grace_s
    if now >= deadline:
        reason = f"timed out after {timeout_s(rollout, spec):g}s (stopped by the controller)"
        return Decision((*actions, Kill(active, reason), after_failure(rollout, spec, reason)))
    return Decision(tuple(actions), wake_at=deadline)


def _decide_requeuing(rollout: Rollout, spec: RunSpec, actions: list[Action], now: float) -> Decision:
    charged = rollout.charged_attempts()
    limit = allowed_attempts(rollout, spec)
    if charged >= limit or len(rollout.attempts) >= limit + UNCHARGED_ALLOWANCE:
        reason = rollout.reason or "the last attempt failed"
        last = rollout.current.attempt_id if rollout.current else None
        gave_up = f"{reason} (gave up after {len(rollout.attempts)} attempt(s))"
        return Decision((*actions, MarkEnded(last, "failed", gave_up)))
    ready_at = rollout.status_time + backoff_s(spec, charged)
    if now < ready_at:
        return Decision(tuple(actions), wake_at=ready_at)
    return Decision((*actions, Start()))


def _vanished(rollout: Rollout, spec: RunSpec) -> MarkEnded:
    current = rollout.current
    assert current is not None
    if rollout.status == "preparing":
        return after_failure(
            rollout,
            spec,
            f"{NOT_LAUNCHED}attempt {current.sequence} was started but its execution never was "
            "(the controller stopped in between)",
            charged=False,
        )
    return after_failure(
        rollout,
        spec,
        f"the execution of attempt {current.sequence} disappeared (removed outside the controller, "
        "or its node or process was lost)",
    )
