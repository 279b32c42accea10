"""Which recorded model calls of a rollout are training data, read from its event history.

A rollout may run several attempts (a crashed agent is retried), and each attempt makes calls.
Only the attempt that succeeded produced the trajectory the reward judges, so only its calls are
kept: the attempt named by the rollout's final `succeeded` status event. Of that attempt's calls,
only those with `status == "ok"` (failed or aborted calls sampled nothing the harness used) and
`mode == "train"` (validation calls never become training samples) are kept, in stream order.
A call is read from a `ModelRequestRecorded` or from a `CallRecord`, the same event decoded with
only the fields read here (a replay decodes that, skipping the request and response bodies).
A version-2 call recorded as a reference to an earlier call of its attempt gets its full prompt
here (the attempt's calls are read in order) and keeps the reference (`Call.prompt_ref`), which
lets `merge_calls` extend that call's chain without comparing token arrays.
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

import time
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from schemas.bounds import Count, Int32
from schemas.codec import MalformedEvent
from schemas.events import (
    TERMINAL_STATUSES,
    AttemptStarted,
    CallStatus,
    Event,
    Mode,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
)
from schemas.refs import CallRef, PackedTokens, unpack_arrays, unpack_together
from trainer.core.failures import FailureKind, endpoint_failed, failure_kind, held_by_updates
from trainer.core.tokens import FloatArray, IdArray, Logprobs, TokenIds


class MalformedCall(ValueError):
    """A successful call whose record cannot be trained on (no prompt ids, or logprobs missing)."""


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """One model call as the adapter sees it: the tokens consumed and sampled, and their logprobs.

    `logprobs[i]` is the behaviour log-probability of `response_ids[i]`; `choice_index` tells
    sibling choices of one request (`n > 1`) apart, so they are never taken for retries.
    `started_at` / `ended_at` (Unix seconds, None when unknown) tell a retry from a fan-out;
    `agent` and `model` (the registered model name) decide whether the run trains the call.
    Ids and logprobs are arrays when read from events (`trainer.core.tokens`); lists also do.
    """

    call_id: str
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: Logprobs
    weights_version: int | None = None
    choice_index: int = 0
    agent: str | None = None
    model: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    finish_reason: str | None = None
    event_id: str | None = None
    """The recorded event's id (None when unknown, or when the attempt recorded it twice)."""
    prompt_ref: str | None = None
    """The event id of the earlier call of the attempt this prompt was recorded as continuing, if any."""
    ref_tokens: int = 0
    """How many tokens of that call's prompt + response this prompt starts with (`prompt_ref.tokens`).

    With `event_id`, what lets `merge_calls` extend a chain without comparing token arrays; both are
    set by `rollout_calls` from the recorded reference, and must agree with `prompt_ids` when set.
    """

    def check_trainable(self) -> Call:
        """This call, or `MalformedCall` when it lacks prompt ids or one logprob per response token."""
        if not len(self.prompt_ids):
            raise MalformedCall(
                f"call {self.call_id} has no prompt token ids; the engine must return token ids "
                "(vLLM: return_token_ids) for calls to be trainable"
            )
        if len(self.logprobs) != len(self.response_ids):
            raise MalformedCall(
                f"call {self.call_id} has {len(self.response_ids)} response tokens but {len(self.logprobs)} "
                "logprobs; the engine must return one logprob per sampled token"
            )
        return self


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

    def trains(self, call: Call) -> bool:
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
    calls: list[Call]
    context: list[Call] = []
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
    error: str | None = None
    choice_index: Count = 0
    weights_version: Int32 | None = None
    prompt_ids: list[Count] = []
    response_ids: list[Count] = []
    logprobs: list[float] = []
    time: float = msgspec.field(default_factory=time.time)
    latency_s: float = 0.0
    model: str = ""
    finish_reason: str | None = None
    agent: str | None = None
    endpoint: str | None = None
    started_at: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    prompt_ref: CallRef | UnsetType | None = UNSET
    packed: PackedTokens | UnsetType | None = UNSET


RecordedCall = ModelRequestRecorded | CallRecord
"""A recorded model call, whole or with the adapter's fields only."""

_call_decoder = msgspec.json.Decoder(CallRecord)


def decode_call(data: bytes) -> CallRecord:
    """A `model_request` event's bytes as a `CallRecord`: request and response bodies skipped, arrays left packed.

    What a reader that feeds the adapter decodes calls into (the trainer, the replay): the adapter
    reads packed arrays straight into numpy arrays and resolves references itself, in order.
    Raises `MalformedEvent` for bytes that are not such an event.
    """
    try:
        return _call_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedEvent(str(exc)) from None


def call_from_event(event: RecordedCall) -> Call:
    """The adapter's view of a recorded call (its ids and logprobs as arrays).

    Raises `MalformedCall` when the record lacks what training needs: prompt token ids, and one
    logprob per response token. Both come from the engine (vLLM: `return_token_ids`, `logprobs`).
    """
    return context_call(event).check_trainable()


def context_call(event: RecordedCall) -> Call:
    """The adapter's view of a recorded call, unchecked (a context call need not be trainable).

    The call started at `started_at` (recorded since schema 2), else `latency_s` before it was
    recorded; it ended when it was recorded (`time`).
    """
    prompt, response, logprobs = call_arrays(event)
    return _call(event, prompt, response, logprobs, None)


def call_arrays(event: RecordedCall) -> tuple[IdArray, IdArray, FloatArray]:
    """The recorded prompt ids (as recorded: after a reference, only the new ones), response ids and logprobs.

    Packed arrays are read straight into numpy arrays (no Python int per token); raises
    `MalformedCall` when they cannot be read.
    """
    try:
        return unpack_arrays(event)
    except (ValueError, TypeError) as exc:  # bad base64, or a length that is not whole values
        raise MalformedCall(f"call {event.call_id}: packed arrays unreadable: {exc}") from None


def calls_arrays(
    events: Sequence[RecordedCall],
) -> tuple[list[tuple[IdArray, IdArray, FloatArray]], IdArray | None]:
    """`call_arrays` of an attempt's calls, all unpacked together, and the one array their ids
    were read from, if any (`schemas.refs.unpack_together`)."""
    try:
        return unpack_together(events)
    except (ValueError, TypeError):
        return [call_arrays(event) for event in events], None  # raises MalformedCall naming the call


def _call(event: RecordedCall, prompt: IdArray, response: IdArray, logprobs: FloatArray, ref: CallRef | None) -> Call:
    started = event.started_at if event.started_at is not None else event.time - event.latency_s
    return Call(
        call_id=event.call_id,
        prompt_ids=prompt,
        response_ids=response,
        logprobs=logprobs,
        weights_version=event.weights_version,
        choice_index=event.choice_index,
        agent=event.agent,
        model=event.endpoint or event.model,
        started_at=started if event.time else None,
        ended_at=event.time or None,
        temperature=event.temperature,
        top_p=event.top_p,
        top_k=event.top_k,
        finish_reason=event.finish_reason,
        event_id=event.event_id,
        prompt_ref=ref.event_id if ref else None,
        ref_tokens=ref.tokens if ref else 0,
    )


class _Prompts:
    """One attempt's calls with their full prompts, references resolved as the calls are read in order.

    Each call's prompt and response are kept by event id; a call that references one gets the
    referenced prompt + response cut at `prompt_ref.tokens`, then its own ids (one array built, the
    earlier arrays shared). The Call keeps the reference for `merge_calls`, except into an event id
    the attempt recorded twice (ambiguous: the later one is the one resolved).

    When the calls' ids were read as one array (`joined`: each call's recorded ids in turn), a call
    that takes the whole of the call before it, as a conversation's next turn does, finds its full
    prompt already there: it is a slice, with no array built.
    """

    __slots__ = ("at", "joined", "repeated", "seen", "tail")

    def __init__(self, joined: IdArray | None = None) -> None:
        self.seen: dict[str, tuple[IdArray, IdArray]] = {}
        self.repeated: set[str] = set()
        self.joined = joined
        self.at = 0  # where the next call's recorded ids start in `joined`
        # (event id, start) of the last call when its full prompt and response are joined[start:at]
        self.tail: tuple[str, int] | None = None

    def call(self, event: RecordedCall, arrays: tuple[IdArray, IdArray, FloatArray]) -> Call:
        """The adapter's view of an `ok` call of the attempt (its `call_arrays` given), with its full prompt."""
        ref = event.prompt_ref
        prompt, response, logprobs = arrays
        start, tail = self.at, self.tail
        self.at += len(prompt) + len(response)
        self.tail = None
        if ref:
            earlier = self.seen.get(ref.event_id)
            if earlier is None:
                raise MalformedCall(
                    f"call {event.call_id}: the referenced call {ref.event_id} (stream sequence {ref.seq}) was not seen"
                )
            before, said = earlier
            shared = ref.tokens
            if self.joined is not None and tail == (ref.event_id, start - shared):
                prompt = self.joined[start - shared : start + len(prompt)]
                self.tail = (event.event_id, start - shared)
            elif shared <= len(before):
                prompt = np.concatenate((before[:shared], prompt))
            else:
                prompt = np.concatenate((before, said[: shared - len(before)], prompt))
            if ref.event_id in self.repeated:
                ref = None
        elif self.joined is not None:
            self.tail = (event.event_id, start)
        call = _call(event, prompt, response, logprobs, ref or None)
        if event.event_id in self.seen:
            self.repeated.add(event.event_id)
            call = msgspec.structs.replace(call, event_id=None)
        self.seen[event.event_id] = (prompt, response)
        return call


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
    attempt, final = _final_attempt(ordered, rollout_id)
    select = select or Selection()
    calls: list[Call] = []
    context: list[Call] = []
    reward: float | None = None
    used = [
        event
        for event in ordered
        if isinstance(event, ModelRequestRecorded | CallRecord)
        and event.attempt_id == attempt
        and event.status == "ok"
        and event.mode == "train"
    ]
    arrays_of, joined = calls_arrays(used)
    prompts = _Prompts(joined)
    for event, arrays in zip(used, arrays_of, strict=True):
        call = prompts.call(event, arrays)
        if select.trains(call):
            calls.append(call.check_trainable())
        else:
            context.append(call)
    for event in ordered:
        if isinstance(event, RewardReported) and event.attempt_id in (attempt, None):
            reward = event.value
    failure: FailureKind | None = None
    if final.status != "succeeded":
        last = max([*calls, *context], key=lambda c: c.ended_at or 0.0, default=None)
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
        failure, reward = kind, None
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
