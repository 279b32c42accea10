"""The batch fold: a batch of events plus the loaded state they touch, in; the rows to write, out.

Pure (no I/O), so it can be checked against a plain event-by-event fold of the stream. Rollout
views are folded with the contract's `fold` (`schemas.rollout`), as every reader does, so they
agree by construction; on top of the view each rollout keeps totals (tokens, samples, flags, ...)
that the view does not carry. Events of a rollout that does not exist (yet) are stored in their own tables
but count toward no rollout, exactly as the view ignores them.

Loading is selective, because model calls dominate and need little: a rollout's attempts list is
loaded only when the batch has status or attempt events for it, its rewards only when the batch
has reward or status events for it (both can change the reward).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from schemas import (
    AttemptStarted,
    CustomEvent,
    ModelRegistered,
    ModelRemoved,
    ModelRequestRecorded,
    PhaseChanged,
    RewardReported,
    RolloutStatusChanged,
    RunStarted,
)
from schemas.events import FLAG_EVENT
from schemas.rollout import RolloutView, fold
from schemas.run import RunView
from schemas.run import fold as fold_run
from services.common.eventstore import StoredEvent
from services.projector import chains as chain_state
from services.projector.flags import flag_names
from services.projector.incoming import Incoming, event_type, nul_escaped_text

_json = msgspec.json.Encoder()

RolloutKey = tuple[str, str]
AttemptKey = tuple[str, str, str]

NEEDS_ATTEMPTS = (RolloutStatusChanged, AttemptStarted)
NEEDS_REWARDS = (RolloutStatusChanged, RewardReported)
RUN_EVENTS = (RunStarted, ModelRegistered, ModelRemoved, PhaseChanged)


class Extras(msgspec.Struct, kw_only=True):
    """A rollout's totals beyond its view (the extra columns of `rollouts`)."""

    attempts: int = 0
    reward: float | None = None
    rewards: int = 0
    calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    samples: int = 0
    custom_events: int = 0
    flags: list[str] = []
    last_seq: int = 0
    last_event_at: float = 0.0
    ended_at: float | None = None


class StatsDelta(msgspec.Struct, kw_only=True):
    """What a batch adds to one `attempt_stats` row; its fields are the row's columns after the key, in order."""

    calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    samples: int = 0
    reward: float | None = None
    reward_seq: int | None = None


class RunDelta(msgspec.Struct, kw_only=True):
    """What a batch adds to one `runs` row (merged with the stored row by the upsert); its fields are
    the row's columns after `run_id`, in order (`pgstore` writes them as they are)."""

    name: str | None = None
    config: str | None = None
    started_at: float | None = None
    started_seq: int | None = None
    phase: str | None = None
    weights_version: int | None = None
    phase_seq: int | None = None
    events: int = 0
    first_seq: int = 0
    last_seq: int = 0
    last_event_at: float = 0.0


class ModelDelta(msgspec.Struct, kw_only=True):
    """The batch's last registration and last removal of one model name; its fields are the `models`
    row's columns after the key, in order."""

    base_url: str | None = None
    served_model: str | None = None
    weights_version: int | None = None
    registered_at: float | None = None
    registered_seq: int | None = None
    removed_at: float | None = None
    removed_seq: int | None = None


class Loaded(msgspec.Struct, kw_only=True):
    """Stored state the batch touches. `views` holds only rollouts that exist."""

    views: dict[RolloutKey, RolloutView] = {}
    extras: dict[RolloutKey, Extras] = {}
    with_attempts: set[RolloutKey] = set()
    with_rewards: set[RolloutKey] = set()
    chains: dict[AttemptKey, bytes] = {}


class Plan(msgspec.Struct, kw_only=True):
    """Everything one batch writes, in one transaction."""

    last_seq: int = 0
    events: list[tuple[Any, ...]] = []
    model_calls: list[tuple[Any, ...]] = []
    full_calls: dict[int, tuple[Any, ...]] = {}  # by seq: a referencing row stored in full (pgstore.call_rows)
    rewards: list[tuple[Any, ...]] = []
    custom_events: list[tuple[Any, ...]] = []
    phases: list[tuple[Any, ...]] = []
    dead_letters: list[tuple[Any, ...]] = []
    created: set[RolloutKey] = set()
    touched: set[RolloutKey] = set()
    views: dict[RolloutKey, RolloutView] = {}
    extras: dict[RolloutKey, Extras] = {}
    with_attempts: set[RolloutKey] = set()
    with_rewards: set[RolloutKey] = set()
    stats: dict[AttemptKey, StatsDelta] = {}
    chains: dict[AttemptKey, bytes] = {}
    runs: dict[str, RunDelta] = {}
    run_views: dict[str, RunView] = {}  # the batch's fold of each run's run, model and phase events
    models: dict[tuple[str, str], ModelDelta] = {}
    rows: Any = None  # every row to write, materialized once folding is done (see pgstore.materialize)


def needs(items: Iterable[Incoming]) -> tuple[set[RolloutKey], set[RolloutKey], set[RolloutKey], set[AttemptKey]]:
    """Keys to load for a batch: touched rollouts, those needing attempts, rewards; call chains."""
    touched: set[RolloutKey] = set()
    attempts: set[RolloutKey] = set()
    rewards: set[RolloutKey] = set()
    calls: set[AttemptKey] = set()
    for item in items:
        event = item.event
        if event is None or event.rollout_id is None:
            continue
        key = (event.run_id, event.rollout_id)
        touched.add(key)
        if isinstance(event, NEEDS_ATTEMPTS):
            attempts.add(key)
        if isinstance(event, NEEDS_REWARDS):
            rewards.add(key)
        if isinstance(event, ModelRequestRecorded) and event.status == "ok":
            calls.add((*key, event.attempt_id or ""))
    return touched, attempts, rewards, calls


def _run_delta(plan: Plan, item: Incoming) -> None:
    """Count the event toward its run's row; fold a run, model or phase event into the batch's run view."""
    event = item.event
    assert event is not None
    delta = plan.runs.get(event.run_id)
    if delta is None:
        delta = plan.runs[event.run_id] = RunDelta(first_seq=item.seq)
    delta.events += 1
    delta.last_seq = item.seq
    delta.last_event_at = event.time
    if isinstance(event, RUN_EVENTS):
        folded = fold_run(
            plan.run_views.get(event.run_id), StoredEvent(seq=item.seq, subject=item.subject, event=event)
        )
        if folded is not None:
            plan.run_views[event.run_id] = folded


def _run_rows(plan: Plan) -> None:
    """The `runs` and `models` rows' parts from the batch's run views (the contract's run fold).

    A batch folds from no view, and the upserts merge it the way the fold does (the first `RunStarted`
    stays, the last registration, removal and phase win), so the rows are the fold of the whole stream."""
    for run_id, view in plan.run_views.items():
        delta = plan.runs[run_id]
        if view.started:
            spec = view.recorded_spec()
            delta.name, delta.config = view.name, _json.encode(spec).decode()
            delta.started_at, delta.started_seq = view.started_at, view.started_seq
        if view.phase is not None:
            delta.phase, delta.weights_version, delta.phase_seq = (
                view.phase.phase,
                view.phase.weights_version,
                view.phase.seq,
            )
        for name, model in view.models.items():
            registered = model.seq > 0
            plan.models[(run_id, name)] = ModelDelta(
                base_url=model.base_url if registered else None,
                served_model=model.served_model,
                weights_version=model.weights_version,
                registered_at=model.registered_at,
                registered_seq=model.seq if registered else None,
                removed_at=model.removed_at,
                removed_seq=model.removed_seq,
            )


def _detail_rows(plan: Plan, item: Incoming) -> None:
    """Rows of the event's own tables (written whether or not a rollout view exists)."""
    event = item.event
    assert event is not None
    plan.events.append(
        (
            item.seq,
            event.run_id,
            event.rollout_id,
            event.attempt_id,
            event_type(event),
            event.event_id,
            event.schema_version,
            event.time,
            item.body,
        )
    )
    if isinstance(event, RewardReported):
        plan.rewards.append(
            (
                item.seq,
                event.run_id,
                event.rollout_id,
                event.attempt_id,
                event.time,
                event.value,
                event.name,
                event.step,
                event.source,
            )
        )
    elif isinstance(event, CustomEvent):
        plan.custom_events.append(
            (
                item.seq,
                event.run_id,
                event.rollout_id,
                event.attempt_id,
                event.time,
                event.name,
                _json.encode(event.payload).decode(),
                event.source,
            )
        )
    elif isinstance(event, PhaseChanged):
        plan.phases.append((item.seq, event.run_id, event.phase, event.weights_version, event.time))


class CallRow(msgspec.Struct, kw_only=True, gc=False):
    """One `model_calls` row: its fields are the table's columns, in order (`pgstore.MODEL_CALL_COLUMNS`).

    A row with `base_seq` stores each token once: its full prompt is the first `base_tokens` ids
    of that earlier row's full prompt + response ids, then `prompt_ids`; its full prompt text the
    first `base_text` characters of that row's full prompt text + response text, then
    `prompt_text`; its full request `request` completed from that row's full request as
    `request_ref` (`same`, `prefix`) says. `calls.py` resolves them on read.
    """

    seq: int
    run_id: str
    rollout_id: str | None
    attempt_id: str | None
    time: float
    call_id: str
    choice_index: int
    mode: str
    status: str
    model: str
    weights_version: int | None
    prompt_ids: bytes
    response_ids: bytes
    logprobs: bytes
    prompt_tokens: int
    response_tokens: int
    prompt_text: str | None
    response_text: str | None
    response_pieces: list[str] | None
    finish_reason: str | None
    request: str
    response: str
    usage: str
    latency_s: float
    error: str | None
    new_sample: bool
    flags: list[str]
    agent: str | None
    endpoint: str | None
    started_at: float | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    api: str
    continuity: str | None
    base_seq: int | None = None
    base_tokens: int = 0
    base_text: int = 0
    request_ref: str | None = None


def _call_row(plan: Plan, item: Incoming, new_sample: bool) -> None:
    """Add the call's row to the plan: its new part when it references an earlier row, else in full."""
    event, call = item.event, item.call
    assert isinstance(event, ModelRequestRecorded) and call is not None
    row = CallRow(
        seq=item.seq,
        run_id=event.run_id,
        rollout_id=event.rollout_id,
        attempt_id=event.attempt_id,
        time=event.time,
        call_id=event.call_id,
        choice_index=event.choice_index,
        mode=event.mode,
        status=event.status,
        model=event.model,
        weights_version=event.weights_version,
        prompt_ids=call.prompt_ids,
        response_ids=call.response_ids,
        logprobs=call.logprobs,
        prompt_tokens=call.prompt_tokens,
        response_tokens=call.response_tokens,
        prompt_text=call.prompt_text,
        response_text=call.response_text,
        response_pieces=call.response_pieces,
        finish_reason=event.finish_reason,
        request=call.request,
        response=call.response,
        usage=call.usage,
        latency_s=event.latency_s,
        error=event.error,
        new_sample=new_sample,
        flags=call.flags,
        agent=nul_escaped_text(event.agent),
        endpoint=nul_escaped_text(event.endpoint),
        started_at=event.started_at,
        temperature=event.temperature,
        top_p=event.top_p,
        top_k=event.top_k,
        api=event.api,
        continuity=nul_escaped_text(event.continuity) if isinstance(event.continuity, str) else None,
    )
    if call.base_seq is not None:
        plan.full_calls[item.seq] = msgspec.structs.astuple(row)
        text = call.prompt_text
        row = msgspec.structs.replace(
            row,
            prompt_ids=call.prompt_ids[4 * call.base_tokens :],
            prompt_text=text[call.base_text :] if text is not None else None,
            base_seq=call.base_seq,
            base_tokens=call.base_tokens,
            base_text=call.base_text,
            request_ref=call.request_ref,
        )
    plan.model_calls.append(msgspec.structs.astuple(row))


def _add_flags(extras: Extras, names: Iterable[str]) -> None:
    merged = set(extras.flags) | set(names)
    if len(merged) != len(extras.flags):
        extras.flags = sorted(merged)


def _fold_call(
    plan: Plan, loaded: Loaded, open_chains: dict[AttemptKey, list[chain_state.Chain]], item: Incoming, extras: Extras
) -> bool:
    """Count an accepted model call toward its rollout and attempt; True if it opens a sample."""
    event, call = item.event, item.call
    assert isinstance(event, ModelRequestRecorded) and call is not None
    akey = (event.run_id, event.rollout_id or "", event.attempt_id or "")
    stats = plan.stats.setdefault(akey, StatsDelta())
    ok = event.status == "ok"
    opens = False
    if ok:
        state = open_chains.get(akey)
        if state is None:
            state = open_chains[akey] = chain_state.load(loaded.chains.get(akey))
        opens = chain_state.advance(state, call.prompt_ids, call.response_ids)
    stats.calls += 1
    stats.failed_calls += not ok
    stats.prompt_tokens += call.prompt_tokens
    stats.response_tokens += call.response_tokens
    stats.samples += opens
    extras.calls += 1
    extras.failed_calls += not ok
    extras.prompt_tokens += call.prompt_tokens
    extras.response_tokens += call.response_tokens
    extras.samples += opens
    if call.flags:
        _add_flags(extras, flag_names(call.flags))
    return opens


def fold_batch(items: Sequence[Incoming], loaded: Loaded) -> Plan:
    """Fold `items` (in stream order, none applied yet) over `loaded`; returns the rows to write."""
    plan = Plan(
        views=loaded.views,
        extras=loaded.extras,
        with_attempts=set(loaded.with_attempts),
        with_rewards=set(loaded.with_rewards),
    )
    open_chains: dict[AttemptKey, list[chain_state.Chain]] = {}
    for item in items:
        plan.last_seq = item.seq
        event = item.event
        if event is None:
            plan.dead_letters.append((item.seq, item.subject, item.error or "undecodable", item.data))
            continue
        _detail_rows(plan, item)
        _run_delta(plan, item)
        if event.rollout_id is None:
            continue
        key = (event.run_id, event.rollout_id)
        before = plan.views.get(key)
        terminal_before = before.terminal_seq if before is not None else 0
        view = fold(before, StoredEvent(seq=item.seq, subject=item.subject, event=event))
        if view is None:
            if item.call is not None:
                _call_row(plan, item, False)
            continue
        if before is None:
            plan.created.add(key)
            plan.with_attempts.add(key)
            plan.with_rewards.add(key)
            plan.extras[key] = Extras()
        plan.views[key] = view
        plan.touched.add(key)
        extras = plan.extras[key]
        extras.last_seq, extras.last_event_at = item.seq, event.time
        if view.terminal_seq != terminal_before:
            extras.ended_at = event.time
        if isinstance(event, ModelRequestRecorded):
            _call_row(plan, item, _fold_call(plan, loaded, open_chains, item, extras))
        elif isinstance(event, RewardReported):
            extras.rewards += 1
            stats = plan.stats.setdefault((*key, event.attempt_id or ""), StatsDelta())
            stats.reward, stats.reward_seq = event.value, item.seq
        elif isinstance(event, CustomEvent):
            extras.custom_events += 1
            if event.name.startswith(FLAG_EVENT) and event.trusted:  # an agent's "flag" is only an event
                _add_flags(extras, [event.name])
    plan.chains = {key: chain_state.dump(state) for key, state in open_chains.items()}
    _run_rows(plan)
    for key in plan.touched:
        extras = plan.extras[key]
        view = plan.views[key]
        if key in plan.with_attempts:
            extras.attempts = len(view.attempts)
        if key in plan.with_rewards:
            extras.reward = view.reward
    return plan
