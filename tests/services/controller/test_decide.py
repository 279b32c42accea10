"""The controller's policy as a pure function: events folded into a view, then `decide`."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from schemas import AnyEvent, AttemptStarted, RolloutCreated, RolloutStatusChanged, RunStarted
from schemas.rollout import fold as fold_rollout
from schemas.run import fold as fold_run
from schemas.runs import RunSpec
from services.common.eventstore import StoredEvent
from services.controller.backends.base import ExecutionKey, ExecutionState
from services.controller.decide import (
    Decision,
    Forget,
    Kill,
    MarkEnded,
    MarkRunning,
    Relaunch,
    Start,
    backoff_s,
    decide,
)
from services.controller.view import NOT_LAUNCHED, Rollout, RunSpecError, compact, run_spec

RUN = "r1"
RID = "ro1"
SPEC = RunSpec(run_id=RUN, command=["true"], max_attempts=3, retry_backoff_s=2.0, timeout_s=30.0)


def fold(view: Rollout | None, event: AnyEvent, seq: int) -> Rollout | None:
    """The controller's fold: the contract's, with a finished rollout's input dropped."""
    return compact(fold_rollout(view, StoredEvent(seq=seq, subject=event.subject, event=event)))


def build(events: Sequence[AnyEvent]) -> Rollout:
    view: Rollout | None = None
    for seq, event in enumerate(events, start=1):
        view = fold(view, event, seq)
    assert view is not None
    return view


def created(max_attempts: int = 3) -> RolloutCreated:
    return RolloutCreated(run_id=RUN, rollout_id=RID, input={"q": 1}, max_attempts=max_attempts, time=100.0)


def status(value: str, attempt: str | None = None, reason: str | None = None, t: float = 100.0) -> RolloutStatusChanged:
    return RolloutStatusChanged(run_id=RUN, rollout_id=RID, attempt_id=attempt, status=value, reason=reason, time=t)  # type: ignore[arg-type]


def attempt(aid: str, n: int, t: float = 100.0) -> AttemptStarted:
    return AttemptStarted(run_id=RUN, rollout_id=RID, attempt_id=aid, sequence=n, time=t)


def ex(aid: str, phase: str, reason: str | None = None, tail: str | None = None) -> ExecutionState:
    return ExecutionState(key=ExecutionKey(RUN, RID, aid), phase=phase, reason=reason, log_tail=tail)  # type: ignore[arg-type]


def test_fold_tracks_attempts_and_is_idempotent() -> None:
    events: list[AnyEvent] = [
        created(),
        status("queuing"),
        attempt("a1", 1),
        status("preparing", "a1"),
        status("running", "a1"),
    ]
    view = build(events)
    assert view.status == "running" and view.active_attempt_id == "a1" and view.input == {"q": 1}
    assert view.attempts[0].reached_running
    # Re-applying an event already folded (same or lower sequence) changes nothing.
    assert fold(view, status("failed", "a1"), 3) == view
    done = fold(view, status("succeeded", "a1"), 6)
    assert done is not None and done.terminal and done.input is None and done.active_attempt_id is None


def test_queued_rollout_starts_an_attempt() -> None:
    view = build([created(), status("queuing")])
    assert decide(view, SPEC, [], now=101.0).actions == (Start(),)


def test_no_spec_waits_and_invalid_spec_fails() -> None:
    view = build([created(), status("queuing")])
    assert decide(view, None, [], now=101.0) == Decision()
    bad = run_spec(
        fold_run(None, StoredEvent(seq=1, subject="s", event=RunStarted(run_id=RUN, config={"backend": "docker"})))
    )
    assert isinstance(bad, RunSpecError) and "backend" in bad.message
    (action,) = decide(view, bad, [], now=101.0).actions
    assert isinstance(action, MarkEnded) and action.status == "failed" and "backend" in (action.reason or "")


def test_an_older_spec_takes_the_run_id_from_the_envelope() -> None:
    event = RunStarted(run_id=RUN, config={"command": ["python", "a.py"], "concurrency": 4})
    spec = run_spec(fold_run(None, StoredEvent(seq=1, subject="s", event=event)))
    assert isinstance(spec, RunSpec) and spec.run_id == RUN and spec.concurrency == 4


def test_preparing_with_running_execution_reports_running_and_waits_for_deadline() -> None:
    view = build([created(), status("queuing"), attempt("a1", 1, t=100.0), status("preparing", "a1")])
    d = decide(view, SPEC, [ex("a1", "running")], now=101.0, kill_grace_s=5.0)
    assert d.actions == (MarkRunning("a1"),) and d.wake_at == 135.0  # started 100 + timeout 30 + grace 5
    pending = decide(view, SPEC, [ex("a1", "pending")], now=101.0)
    assert pending.actions == ()


def test_rollout_timeout_overrides_the_run_timeout() -> None:
    own = RolloutCreated(run_id=RUN, rollout_id=RID, config={"timeout_seconds": 5}, time=100.0)
    view = build([own, status("queuing"), attempt("a1", 1, t=100.0), status("preparing", "a1")])
    assert decide(view, SPEC, [ex("a1", "running")], now=101.0, kill_grace_s=1.0).wake_at == 106.0


def test_preparing_without_execution_relaunches_the_same_attempt() -> None:
    view = build([created(), status("queuing"), status("preparing", "a1"), attempt("a1", 1)])
    assert view.current is not None and view.current.sequence == 1
    assert decide(view, SPEC, [], now=101.0).actions == (Relaunch("a1", 1),)
    never = ex("a1", "failed", reason=NOT_LAUNCHED + "the launcher stopped")
    assert decide(view, SPEC, [never], now=101.0).actions == (Relaunch("a1", 1),)


def test_ended_execution_reports_success_through_running() -> None:
    preparing = build([created(), status("queuing"), attempt("a1", 1), status("preparing", "a1")])
    assert decide(preparing, SPEC, [ex("a1", "succeeded")], now=101.0).actions == (MarkRunning("a1"),)
    running = fold(preparing, status("running", "a1"), 10)
    assert running is not None
    assert decide(running, SPEC, [ex("a1", "succeeded")], now=101.0).actions == (MarkEnded("a1", "succeeded"),)


def test_failure_retries_until_max_attempts_then_fails_with_last_reason() -> None:
    events: list[AnyEvent] = [created(), status("queuing")]
    for n in (1, 2, 3):
        aid = f"a{n}"
        events += [attempt(aid, n), status("preparing", aid), status("running", aid)]
        view = build(events)
        (action,) = decide(view, SPEC, [ex(aid, "failed", reason=f"agent exited with code {n}")], now=101.0).actions
        assert isinstance(action, MarkEnded)
        if n < 3:
            assert action == MarkEnded(aid, "requeuing", f"agent exited with code {n}")
        else:
            assert action.status == "failed" and (action.reason or "").startswith("agent exited with code 3")
            assert "gave up after 3 of 3 attempt(s)" in (action.reason or "")
        events.append(status(action.status, aid, action.reason, t=100.0))


def test_failure_reason_carries_the_log_tail() -> None:
    view = build([created(), status("queuing"), attempt("a1", 1), status("preparing", "a1"), status("running", "a1")])
    (action,) = decide(
        view, RunSpec(run_id=RUN), [ex("a1", "failed", "agent exited with code 1", "ValueError: bad")], now=101.0
    ).actions
    assert isinstance(action, MarkEnded) and action.status == "requeuing"
    assert (action.reason or "").startswith("agent exited with code 1\nlast lines of the log:\nValueError: bad")


def test_requeuing_waits_for_backoff() -> None:
    view = build(
        [
            created(),
            status("queuing"),
            attempt("a1", 1),
            status("preparing", "a1"),
            status("running", "a1"),
            status("requeuing", "a1", "boom", t=100.0),
        ]
    )
    d = decide(view, SPEC, [ex("a1", "failed", reason="boom")], now=101.0)
    assert d.actions == (Forget("a1"),) and d.wake_at == 102.0
    assert decide(view, SPEC, [], now=102.0).actions == (Start(),)
    assert backoff_s(SPEC, 3) == 8.0


def test_rollout_level_max_attempts_raises_the_run_limit() -> None:
    spec = RunSpec(run_id=RUN, max_attempts=1, retry_backoff_s=0)
    view = build(
        [
            created(max_attempts=2),
            status("queuing"),
            attempt("a1", 1),
            status("preparing", "a1"),
            status("running", "a1"),
        ]
    )
    (action,) = decide(view, spec, [ex("a1", "failed", reason="x")], now=101.0).actions
    assert isinstance(action, MarkEnded) and action.status == "requeuing"


def test_running_without_execution_is_a_failure() -> None:
    view = build([created(), status("queuing"), attempt("a1", 1), status("preparing", "a1"), status("running", "a1")])
    (action,) = decide(view, RunSpec(run_id=RUN), [], now=101.0).actions
    assert isinstance(action, MarkEnded) and action.status == "requeuing" and "disappeared" in (action.reason or "")


def test_timeout_backstop_kills_after_grace_and_reports() -> None:
    view = build(
        [created(), status("queuing"), attempt("a1", 1, t=100.0), status("preparing", "a1"), status("running", "a1")]
    )
    d = decide(view, SPEC, [ex("a1", "running")], now=141.0, kill_grace_s=10.0)
    reason = "timed out after 30s (stopped by the controller)"
    assert d.actions == (Kill("a1", reason), MarkEnded("a1", "requeuing", reason, "timeout"))


@pytest.mark.parametrize("final", ["failed", "cancelled"])
def test_cancelled_rollout_kills_its_execution(final: str) -> None:
    view = build(
        [
            created(),
            status("queuing"),
            attempt("a1", 1),
            status("preparing", "a1"),
            status("running", "a1"),
            status(final, "a1", "by hand"),
        ]
    )
    assert decide(view, SPEC, [ex("a1", "running")], now=101.0).actions == (Kill("a1", f"the rollout is {final}"),)
    assert decide(view, SPEC, [ex("a1", "failed")], now=101.0).actions == (Forget("a1"),)


def test_superseded_attempt_is_killed_and_current_one_kept() -> None:
    view = build(
        [
            created(),
            status("queuing"),
            attempt("a1", 1),
            status("preparing", "a1"),
            status("running", "a1"),
            status("requeuing", "a1", "x"),
            attempt("a2", 2),
            status("preparing", "a2"),
        ]
    )
    d = decide(view, SPEC, [ex("a1", "running"), ex("a2", "running")], now=101.0)
    assert d.actions[0] == Kill("a1", "its attempt is no longer current")
    assert MarkRunning("a2") in d.actions


def test_the_failure_cause_goes_with_the_status_the_controller_writes() -> None:
    """A backend's structured cause, the controller's own timeout and a vanished execution each end
    the attempt with their `cause`; giving up after a requeue keeps the last attempt's cause."""
    running = build([created(max_attempts=2), status("queuing"), attempt("a1", 1), status("preparing", "a1"),
                     status("running", "a1")])  # fmt: skip
    oom = ExecutionState(key=ExecutionKey(RUN, RID, "a1"), phase="failed", reason="agent was killed by SIGKILL",
                         cause="infrastructure")  # fmt: skip
    (action,) = decide(running, SPEC, [oom], now=101.0).actions
    assert action == MarkEnded("a1", "requeuing", "agent was killed by SIGKILL", "infrastructure")
    (action,) = decide(running, SPEC, [], now=101.0).actions
    assert isinstance(action, MarkEnded) and action.cause == "infrastructure"
    requeued = build([created(max_attempts=1), status("queuing"), attempt("a1", 1), status("preparing", "a1"),
                      RolloutStatusChanged(run_id=RUN, rollout_id=RID, attempt_id="a1", status="requeuing",
                                           reason="timed out", cause="timeout", time=100.0)])  # fmt: skip
    (action,) = decide(requeued, SPEC, [], now=200.0).actions
    assert action == MarkEnded("a1", "failed", "timed out (gave up after 1 of 1 attempt(s))", "timeout")
