"""Which recorded model calls of a rollout are training data, read from its event history.

A rollout may run several attempts (a crashed agent is retried), and each attempt makes calls.
Only the attempt that succeeded produced the trajectory the reward judges, so only its calls are
kept: the attempt named by the rollout's final `succeeded` status event. Of that attempt's calls,
only those with `status == "ok"` (failed or aborted calls sampled nothing the harness used) and
`mode == "train"` (validation calls never become training samples) are kept, in stream order.
A call is read from a `ModelRequestRecorded` or from a `schemas.calls.CallRecord` (the same event
with only the adapter's fields) as a `CallTokens`, references resolved (`trainer.core.recorded`).
The reward is the last `RewardReported` of that attempt (or one reported for the rollout as a
whole, without an attempt id); `None` when there is none, and `AdapterConfig.missing_reward`
decides later whether such a rollout is dropped or filled.

Which calls are trained is a `Selection` (agent names, registered model names): the selected calls
are `calls` (checked trainable), every other `ok` call of the attempt is `context` (never trained,
never fatal: a judge, a frozen helper, an external API without token ids). Context calls still
count for dedup (an answer a later call extends was used) and their tokens reach samples only as
observations inside a trained call's prompt. A rollout that failed is trainable when the policy
caused it (`trainer.core.failures`): its last attempt's calls, with `failure` set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec

from schemas.calls import CallRecord
from schemas.events import (
    TERMINAL_STATUSES,
    AttemptStarted,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
)
from trainer.core.failures import FailureKind, endpoint_failed, failure_kind, held_by_updates
from trainer.core.recorded import CallTokens, resolved_calls


def same_model(endpoint: str, model: str) -> bool:
    """Whether a call's registered endpoint is `model` or one of its replicas (`{model}-r{i}`)."""
    if endpoint == model:
        return True
    head, _, index = endpoint.rpartition("-r")
    return head == model and index.isdigit()


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """Which calls a run trains: agent names and registered model names (empty: no restriction)."""

    agents: tuple[str, ...] = ()
    models: tuple[str, ...] = ()

    def trains(self, call: CallTokens) -> bool:
        """True when the call is training data under this selection."""
        if self.agents and call.agent not in self.agents:
            return False
        return not self.models or any(same_model(call.model, m) for m in self.models)


class RolloutCalls(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout's training calls (ordered) and its reward: the adapter's input unit."""

    run_id: str
    rollout_id: str
    group_id: str | None
    attempt_id: str | None
    reward: float | None
    calls: list[CallTokens]
    context: list[CallTokens] = []
    """The attempt's other `ok` calls (not selected): never trained, kept for dedup and counts."""
    group_size: int | None = None
    """Rollouts declared in its group (`RolloutCreated.metadata["group_size"]`, set by the trainer)."""
    failure: FailureKind | None = None
    """Set when the rollout failed: `timeout`, `agent-error` or `length` (the policy's doing)."""

    def for_model(self, model: str) -> RolloutCalls:
        """The rollout with only the calls to `model` trained; the other trained calls become context."""
        mine = [c for c in self.calls if same_model(c.model, model)]
        others = [c for c in self.calls if not same_model(c.model, model)]
        return msgspec.structs.replace(self, calls=mine, context=[*self.context, *others])


class NotTrainable(ValueError):
    """A rollout that yields no training data; `reason` says why (see `SKIP_REASONS`)."""

    def __init__(self, rollout_id: str | None, reason: str, detail: str = "") -> None:
        super().__init__(f"rollout {rollout_id} is not trainable: {reason}{f' ({detail})' if detail else ''}")
        self.rollout_id = rollout_id
        self.reason = reason


SKIP_REASONS = ("no-created-event", "val-mode", "not-succeeded", "infrastructure")


def final_attempt(events: Iterable[Event | CallRecord]) -> tuple[str | None, RolloutStatusChanged | None]:
    """The attempt a rollout's history ends with, and its final status event (None when it has none).

    The attempt is the one the final status names; a status without an attempt id falls back to
    the last `AttemptStarted`, and a rollout that never tracked attempts yields `None`, which then
    matches calls recorded without one.
    """
    final: RolloutStatusChanged | None = None
    last_started: str | None = None
    for event in events:
        if isinstance(event, RolloutStatusChanged):
            final = event
        elif isinstance(event, AttemptStarted):
            last_started = event.attempt_id
    attempt = final.attempt_id if final is not None and final.attempt_id is not None else last_started
    return attempt, final


def _final_attempt(
    events: Sequence[Event | CallRecord], rollout_id: str | None
) -> tuple[str | None, RolloutStatusChanged]:
    """`final_attempt`, whose final status must be terminal (else `NotTrainable`)."""
    attempt, final = final_attempt(events)
    if final is None or final.status not in TERMINAL_STATUSES:
        raise NotTrainable(rollout_id, "not-succeeded", f"final status {final.status if final else 'none'}")
    return attempt, final


def _endpoint_down(events: Sequence[Event | CallRecord], attempt: str | None) -> bool:
    """Whether the attempt's last recorded call failed at the endpoint (`failures.endpoint_failed`)."""
    last: ModelRequestRecorded | CallRecord | None = None
    for event in events:
        if isinstance(event, ModelRequestRecorded | CallRecord) and event.attempt_id == attempt:
            if last is None or event.time >= last.time:
                last = event
    return last is not None and last.status == "failed" and endpoint_failed(last.error)


def rollout_calls(
    events: Iterable[Event | CallRecord],
    select: Selection | None = None,
    updates: Sequence[tuple[float, float]] = (),
) -> RolloutCalls:
    """The training calls and reward of one rollout, from its events in stream order.

    `select` says which calls are trained (default: all); the attempt's other `ok` calls are
    `context`. A rollout that failed because of the policy (see `trainer.core.failures`) is returned
    with `failure` set and no reward; the adapter scores it. Raises `NotTrainable` for a rollout
    that yields no training data (no `RolloutCreated` seen, declared in `val` mode, not ended, or
    ended by the infrastructure or a cancel; a timeout of an attempt that overlapped one of the
    run's `updates`, `(began, ended)` of each update phase, counted time the phase gate held it, so it
    is the infrastructure's too), and `MalformedCall` for a selected call that cannot
    be trained on. Events of another rollout are an error (`ValueError`).
    """
    ordered = list(events)
    rollout_id, created = _created(ordered)
    attempt, final = _final_attempt(ordered, rollout_id)
    select = select or Selection()
    calls: list[CallTokens] = []
    context: list[CallTokens] = []
    reward: float | None = None
    used = [
        event
        for event in ordered
        if isinstance(event, ModelRequestRecorded | CallRecord)
        and event.attempt_id == attempt
        and event.status == "ok"
        and event.mode == "train"
    ]
    for call in resolved_calls(used):
        if select.trains(call):
            calls.append(call.check_trainable())
        else:
            context.append(call)
    for event in ordered:
        if isinstance(event, RewardReported) and event.attempt_id in (attempt, None):
            reward = event.value
    failure: FailureKind | None = None
    if final.status != "succeeded":
        failure = _policy_failure(ordered, rollout_id, attempt, final, [*calls, *context], updates)
        reward = None
    return RolloutCalls(
        run_id=created.run_id,
        rollout_id=rollout_id,
        group_id=created.group_id,
        attempt_id=attempt,
        reward=reward,
        calls=calls,
        context=context,
        failure=failure,
        group_size=_group_size(created),
    )


def _created(ordered: list[Event | CallRecord]) -> tuple[str, RolloutCreated]:
    """The rollout's id and its `RolloutCreated` (`NotTrainable` without one or in `val` mode)."""
    rollout_id = next((e.rollout_id for e in ordered if e.rollout_id is not None), None)
    created: RolloutCreated | None = None
    for event in ordered:
        if event.rollout_id is not None and event.rollout_id != rollout_id:
            raise ValueError(f"events of rollouts {rollout_id} and {event.rollout_id} mixed; pass one rollout's events")
        if isinstance(event, RolloutCreated):
            created = event
    if created is None or rollout_id is None:
        raise NotTrainable(rollout_id, "no-created-event", "replay the rollout's whole history")
    if created.mode != "train":
        raise NotTrainable(rollout_id, "val-mode")
    return rollout_id, created


def _policy_failure(
    ordered: list[Event | CallRecord],
    rollout_id: str,
    attempt: str | None,
    final: RolloutStatusChanged,
    calls: list[CallTokens],
    updates: Sequence[tuple[float, float]],
) -> FailureKind:
    """The policy's failure that ended the attempt (`NotTrainable` when the policy did not cause it)."""
    last = max(calls, key=lambda c: c.ended_at or 0.0, default=None)
    down = _endpoint_down(ordered, attempt)
    kind = failure_kind(final.status, final.reason, last.finish_reason if last else None, final.cause, down)
    if kind is None or final.status == "cancelled":
        raise NotTrainable(rollout_id, "not-succeeded", f"final status {final.status}")
    if kind in ("timeout", "length") and final.cause == "timeout" and updates:
        began = next((e.time for e in ordered if isinstance(e, AttemptStarted) and e.attempt_id == attempt), None)
        if began is not None and held_by_updates(began, final.time, updates):
            kind = "infrastructure"
    if kind == "infrastructure":
        raise NotTrainable(rollout_id, "infrastructure", final.reason or "")
    return kind


def _group_size(created: RolloutCreated) -> int | None:
    size = created.metadata.get("group_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


class CollectedRollouts(msgspec.Struct, frozen=True, kw_only=True):
    """The trainable rollouts of an event history, and why each other rollout was skipped."""

    rollouts: list[RolloutCalls]
    skipped: dict[str, str]


def events_by_rollout(events: Iterable[Event]) -> dict[str, list[Event]]:
    """Split an event history (a run, or several) into each rollout's ordered events."""
    grouped: dict[str, list[Event]] = {}
    for event in events:
        if event.rollout_id is not None:
            grouped.setdefault(event.rollout_id, []).append(event)
    return grouped


def collect_rollouts(
    events: Iterable[Event] | Mapping[str, Sequence[Event]], select: Selection | None = None
) -> CollectedRollouts:
    """`rollout_calls` for every rollout in an event history, in order of first appearance.

    Accepts a flat event stream (a run replayed from `rl.<run>.>`) or events already split by
    rollout id. Rollouts that yield no training data are listed in `skipped` with their reason.
    """
    grouped = events if isinstance(events, Mapping) else events_by_rollout(events)
    rollouts: list[RolloutCalls] = []
    skipped: dict[str, str] = {}
    for rollout_id, rollout_events in grouped.items():
        try:
            rollouts.append(rollout_calls(rollout_events, select))
        except NotTrainable as exc:
            skipped[rollout_id] = exc.reason
    return CollectedRollouts(rollouts=rollouts, skipped=skipped)
