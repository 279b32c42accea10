"""Which recorded model calls of a rollout are training data, read from its event history.

A rollout may run several attempts (a crashed agent is retried), and each attempt makes calls.
Only the attempt that succeeded produced the trajectory the reward judges, so only its calls are
kept: the attempt named by the rollout's final `succeeded` status event. Of that attempt's calls,
only those with `status == "ok"` (failed or aborted calls sampled nothing the harness used) and
`mode == "train"` (validation calls never become training samples) are kept, in stream order.
A call is read from a `ModelRequestRecorded` or from a `CallRecord`, the same event decoded with
only the fields read here (a replay decodes that, skipping the request and response bodies).
The reward is the last `RewardReported` of that attempt (or one reported for the rollout as a
whole, without an attempt id); `None` when there is none, and `AdapterConfig.missing_reward`
decides later whether such a rollout is dropped or filled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec
from msgspec import UNSET, UnsetType

from schemas.bounds import Count, Int32
from schemas.events import (
    AttemptStarted,
    CallStatus,
    Event,
    Mode,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
)
from schemas.refs import CallRef, PackedTokens, Resolver, UnresolvedReference


class MalformedCall(ValueError):
    """A successful call whose record cannot be trained on (no prompt ids, or logprobs missing)."""


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """One model call as the adapter sees it: the tokens consumed and sampled, and their logprobs.

    `logprobs[i]` is the behaviour log-probability of `response_ids[i]`; `choice_index` tells
    sibling choices of one request (`n > 1`) apart, so they are never taken for retries.
    """

    call_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    weights_version: int | None = None
    choice_index: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise MalformedCall(
                f"call {self.call_id} has no prompt token ids; the engine must return token ids "
                "(vLLM: return_token_ids) for calls to be trainable"
            )
        if len(self.logprobs) != len(self.response_ids):
            raise MalformedCall(
                f"call {self.call_id} has {len(self.response_ids)} response tokens but {len(self.logprobs)} "
                "logprobs; the engine must return one logprob per sampled token"
            )


class RolloutCalls(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout's training calls (ordered) and its reward: the adapter's input unit."""

    run_id: str
    rollout_id: str
    group_id: str | None
    attempt_id: str | None
    reward: float | None
    calls: list[Call]


class NotTrainable(ValueError):
    """A rollout that yields no training data; `reason` says why (see `SKIP_REASONS`)."""

    def __init__(self, rollout_id: str | None, reason: str, detail: str = "") -> None:
        super().__init__(f"rollout {rollout_id} is not trainable: {reason}{f' ({detail})' if detail else ''}")
        self.rollout_id = rollout_id
        self.reason = reason


SKIP_REASONS = ("no-created-event", "val-mode", "not-succeeded")


class CallRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A `model_request` event with only the fields the adapter reads (decoded from the same JSON).

    A recorded call also carries the request and response bodies (the conversation's text), often
    most of its bytes; decoding into this type skips them. Same names, types and defaults as
    `ModelRequestRecorded`, so either gives the same `Call`.
    """

    run_id: str
    rollout_id: str | None = None
    attempt_id: str | None = None
    event_id: str = msgspec.field(default_factory=str)
    call_id: str
    mode: Mode = "train"
    status: CallStatus = "ok"
    choice_index: Count = 0
    weights_version: Int32 | None = None
    prompt_ids: list[Count] = []
    response_ids: list[Count] = []
    logprobs: list[float] = []
    prompt_ref: CallRef | UnsetType | None = UNSET
    packed: PackedTokens | UnsetType | None = UNSET


RecordedCall = ModelRequestRecorded | CallRecord
"""A recorded model call, whole or with the adapter's fields only."""


def call_from_event(event: RecordedCall) -> Call:
    """The adapter's view of a recorded call (token lists are shared, not copied).

    Raises `MalformedCall` when the record lacks what training needs: prompt token ids, and one
    logprob per response token. Both come from the engine (vLLM: `return_token_ids`, `logprobs`).
    """
    return Call(
        call_id=event.call_id,
        prompt_ids=event.prompt_ids,
        response_ids=event.response_ids,
        logprobs=event.logprobs,
        weights_version=event.weights_version,
        choice_index=event.choice_index,
    )


def _resolved(refs: Resolver, event: RecordedCall) -> RecordedCall:
    """The call with its full prompt ids (a version-2 call may store only what it adds to an earlier one)."""
    try:
        return refs.resolve(event)
    except UnresolvedReference as exc:
        raise MalformedCall(f"call {event.call_id}: {exc}") from None


def _succeeded_attempt(events: Sequence[Event | CallRecord], rollout_id: str | None) -> str | None:
    """The attempt id of the final status event, which must say `succeeded`.

    A `succeeded` event without an attempt id falls back to the last `AttemptStarted`; a rollout
    that never tracked attempts yields `None`, which then matches calls recorded without one.
    """
    final: RolloutStatusChanged | None = None
    last_started: str | None = None
    for event in events:
        if isinstance(event, RolloutStatusChanged):
            final = event
        elif isinstance(event, AttemptStarted):
            last_started = event.attempt_id
    if final is None or final.status != "succeeded":
        raise NotTrainable(rollout_id, "not-succeeded", f"final status {final.status if final else 'none'}")
    return final.attempt_id if final.attempt_id is not None else last_started


def rollout_calls(events: Iterable[Event | CallRecord]) -> RolloutCalls:
    """The training calls and reward of one rollout, from its events in stream order.

    Raises `NotTrainable` for a rollout that yields no training data (no `RolloutCreated` seen,
    declared in `val` mode, or not finished as succeeded), and `MalformedCall` for a kept call that
    cannot be trained on. Events of another rollout are an error (`ValueError`).
    """
    ordered = list(events)
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
    attempt = _succeeded_attempt(ordered, rollout_id)
    calls: list[Call] = []
    reward: float | None = None
    refs = Resolver(requests=False)
    for event in ordered:
        if isinstance(event, ModelRequestRecorded | CallRecord):
            if event.attempt_id == attempt and event.status == "ok" and event.mode == "train":
                calls.append(call_from_event(_resolved(refs, event)))
        elif isinstance(event, RewardReported) and event.attempt_id in (attempt, None):
            reward = event.value
    return RolloutCalls(
        run_id=created.run_id,
        rollout_id=rollout_id,
        group_id=created.group_id,
        attempt_id=attempt,
        reward=reward,
        calls=calls,
    )


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


def collect_rollouts(events: Iterable[Event] | Mapping[str, Sequence[Event]]) -> CollectedRollouts:
    """`rollout_calls` for every rollout in an event history, in order of first appearance.

    Accepts a flat event stream (a run replayed from `rl.<run>.>`) or events already split by
    rollout id. Rollouts that yield no training data are listed in `skipped` with their reason.
    """
    grouped = events if isinstance(events, Mapping) else events_by_rollout(events)
    rollouts: list[RolloutCalls] = []
    skipped: dict[str, str] = {}
    for rollout_id, rollout_events in grouped.items():
        try:
            rollouts.append(rollout_calls(rollout_events))
        except NotTrainable as exc:
            skipped[rollout_id] = exc.reason
    return CollectedRollouts(rollouts=rollouts, skipped=skipped)
