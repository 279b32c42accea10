"""Reading a past run for replay in two passes, so memory is bounded by the groups running together, not the run.

The advantages of a rollout only need its group; the loss weights need step totals, which are
small numbers. So a run is read in two passes over the stream, never all at once:

1. **Index** (small events only): the newest `created`, `status`, `reward` and trainer step
   record (`event.train_step`) of every rollout, plus the run's `RunStarted` (one read per
   subject filter, concurrently, merged in stream order) and the number of recorded calls per
   rollout (from the stream's per-subject counts, no message read). The newest of each is all the
   adapter reads (the final status, the last reward of the final attempt: a rollout whose newest
   reward is of another attempt gets all its rewards read; a rollout whose final status names no
   attempt gets its newest `attempt`), and the server finds them from its subject index instead of
   testing every message of the stream against a wildcard. From this the index knows each
   rollout's group, step and order, and which rollouts the trainer would skip (the adapter's own
   `rollout_calls` decides, on the small events alone).
2. **Calls**: one sequential read of the run's `model_request` events from the first planned
   rollout on; a unit's calls are held only until the last of them arrives (the index knows each
   rollout's count), then decoded (as `CallRecord`s: the request and response bodies are
   skipped) and handed to the adapter's `rollout_calls` merged in stream order with the small
   events, exactly as if the rollout's whole history had been read.

A replay unit is one group of one trainer step: advantages are per group, and a group the trainer
cut across steps was normalized within each step. A step is what the trainer recorded for the
rollout: a `CustomEvent` named `train_step` with payload `{"step": N, ...}` (with the weights
version and staleness limit of an async step, whose stale calls the replay drops as the trainer
did, and the adapter config the trainer used); in a run without any such
event, the `step` the trainer put in each rollout's creation metadata (the step that declared it,
which is the step that trained it in sync mode). A run without either is one batch (step `None`).
"""

from __future__ import annotations

import asyncio
import heapq
import json
from collections.abc import AsyncIterator, Mapping
from operator import itemgetter
from typing import Any

import msgspec

from schemas.calls import decode_call
from schemas.events import AnyEvent, CustomEvent, RewardReported, RolloutCreated, RunStarted
from schemas.ids import MODEL_REQUEST, REWARD, ROLLOUT_ATTEMPT, RUN_ALL, check_id
from schemas.run import InvalidRunSpec, spec_of
from services.common.eventstore import EventStore, StoredEvent
from services.common.streamread import stream_sequence
from trainer.core import (
    TRAIN_STEP_EVENT,
    MalformedCall,
    NotTrainable,
    RolloutCalls,
    Selection,
    drop_stale_calls,
    rollout_calls,
)
from trainer.core.calls import final_attempt

_by_sequence = itemgetter(0)
"""The stream sequence of a `(sequence, event)` pair."""

CALL_BUDGET = 2048
"""Calls per batch of units handed to the adapter (whole units; one larger unit goes alone)."""


STREAM_NOT_FOUND = 10059


class ReplayError(RuntimeError):
    """A replay that cannot be done (no such run, no such step); the message says what to do."""


class StreamMissing(ReplayError):
    """The event store's stream does not exist (nothing was ever recorded on this server)."""


class RunNotFound(ReplayError):
    """No event of the run is on the stream."""


class RolloutEntry(msgspec.Struct, kw_only=True):
    """What the index knows of one rollout (mutable while the index is built)."""

    rollout_id: str
    order: int
    """Stream sequence of its first indexed event: the order the trainer's `collect_rollouts` sees."""
    group_id: str | None = None
    step: int | None = None
    declared_step: int | None = None
    """`RolloutCreated.metadata["step"]`: the step that declared the rollout (the fallback step record)."""
    stale_limit: tuple[int, int] | None = None
    """(weights version trained, max staleness) when the trainer dropped stale calls (async)."""
    calls: int = 0
    events: list[tuple[int, AnyEvent]] = []
    skip: str | None = None


class RunIndex(msgspec.Struct, kw_only=True):
    """Pass 1 of a replay: every rollout of the run, its group, step and whether it is trainable."""

    run_id: str
    rollouts: dict[str, RolloutEntry]
    recorded_adapter: dict[str, Any] | None
    has_steps: bool

    @property
    def steps(self) -> list[int]:
        """The trainer steps recorded in the run, ascending."""
        return sorted({e.step for e in self.rollouts.values() if e.step is not None})

    def skipped(self) -> dict[str, str]:
        """Rollouts that give no training data, with the adapter's reason."""
        return {rid: e.skip for rid, e in self.rollouts.items() if e.skip is not None}


class Unit(msgspec.Struct, frozen=True, kw_only=True):
    """One replay unit: the trainable rollouts of one group in one step, in run order."""

    step: int | None
    group_id: str | None
    rollout_ids: list[str]
    calls: int
    stale_limit: tuple[int, int] | None = None
    """(weights version trained, max staleness) when the trainer dropped stale calls in this step."""


async def subject_counts(store: EventStore, subject_filter: str) -> dict[str, int]:
    """Messages per subject matching `subject_filter`, from the stream's info (paged; no message read)."""
    counts: dict[str, int] = {}
    offset = 0
    while True:
        request = json.dumps({"subjects_filter": subject_filter, "offset": offset}).encode()
        reply = await store.nc.request(f"$JS.API.STREAM.INFO.{store.stream}", request, timeout=10.0)
        answer = json.loads(reply.data)
        if "error" in answer:
            if answer["error"].get("err_code") == STREAM_NOT_FOUND:
                raise StreamMissing(f"the stream {store.stream} does not exist; nothing was recorded on this server")
            raise ReplayError(f"the stream refused its info: {answer['error'].get('description', answer['error'])}")
        page = answer.get("state", {}).get("subjects") or {}
        counts.update(page)
        offset += len(page)
        if not page or offset >= answer.get("total", 0):
            return counts


async def call_counts(store: EventStore, run_id: str) -> dict[str, int]:
    """Recorded calls per `model_request` subject of the run (no message read)."""
    return await subject_counts(store, MODEL_REQUEST.format(run=check_id("run_id", run_id), rollout="*"))


async def run_exists(store: EventStore, run_id: str) -> bool:
    """True when at least one event of the run is on the stream."""
    import nats.js.errors

    try:
        await store.js.get_last_msg(store.stream, RUN_ALL.format(run=check_id("run_id", run_id)))
    except nats.js.errors.NotFoundError:
        return False
    return True


def _small_subjects(run_id: str) -> list[tuple[str, bool]]:
    """The index's subject filters, each with whether only the newest message per subject is read."""
    prefix = f"rl.{run_id}"
    return [
        (f"{prefix}.run", False),
        (f"{prefix}.rollout.*.created", True),
        (f"{prefix}.rollout.*.status", True),
        (f"{prefix}.rollout.*.reward", True),
        (f"{prefix}.rollout.*.event.{TRAIN_STEP_EVENT}", True),
    ]


async def _read_compacted(store: EventStore, subject: str, last_per_subject: bool = False) -> list[StoredEvent]:
    """The subject's events, compacted (`_compact`), sorted by stream sequence."""
    found = [
        msgspec.structs.replace(stored, event=_compact(stored.event))
        async for stored in store.read(subject, last_per_subject=last_per_subject)
    ]
    found.sort(key=lambda stored: stored.seq)
    return found


async def _small_events(store: EventStore, run_id: str) -> list[StoredEvent]:
    """The run's small events (`_small_subjects`), compacted, in stream order.

    One read per subject filter, run concurrently: one consumer with several filters is markedly
    slower than a consumer per filter, and concurrent reads overlap the server's lookups with
    this process's decoding.
    """
    reads = (_read_compacted(store, subject, last) for subject, last in _small_subjects(run_id))
    per_subject = await asyncio.gather(*reads)
    return list(heapq.merge(*per_subject, key=lambda stored: stored.seq))


ATTEMPTS_ONE_BY_ONE = 64
"""Up to this many rollouts needing their attempt are read one by one; more, with one wildcard read."""


def _needs_attempt(entry: RolloutEntry) -> bool:
    """True when the rollout's final status names no attempt: the adapter then takes its newest `AttemptStarted`."""
    _, final = final_attempt(event for _, event in entry.events)
    return final is not None and final.attempt_id is None


async def _add_attempts(store: EventStore, run_id: str, rollouts: Mapping[str, RolloutEntry]) -> None:
    """Give the rollouts whose final status names no attempt their newest `AttemptStarted` (in stream order).

    Statuses name their attempt (the controller's and the trainer's do), so usually none is read.
    """
    needing = [entry for entry in rollouts.values() if _needs_attempt(entry)]
    if not needing:
        return
    if len(needing) <= ATTEMPTS_ONE_BY_ONE:
        found = await asyncio.gather(
            *(store.last(ROLLOUT_ATTEMPT.format(run=run_id, rollout=entry.rollout_id)) for entry in needing)
        )
        attempts = [stored for stored in found if stored is not None]
    else:
        attempts = await _read_compacted(store, ROLLOUT_ATTEMPT.format(run=run_id, rollout="*"), True)
    wanted = {entry.rollout_id for entry in needing}
    for stored in attempts:
        rollout_id = stored.event.rollout_id
        if rollout_id in wanted:
            entry = rollouts[rollout_id]
            entry.events = list(heapq.merge(entry.events, [(stored.seq, stored.event)], key=lambda pair: pair[0]))


def _other_attempts_reward(entry: RolloutEntry) -> bool:
    """True when the rollout's newest reward is of an attempt other than its final one (read all its rewards)."""
    reward = next((e for _, e in reversed(entry.events) if isinstance(e, RewardReported)), None)
    if reward is None or reward.attempt_id is None:
        return False
    attempt, _ = final_attempt(event for _, event in entry.events)
    return reward.attempt_id != attempt


async def _all_rewards(store: EventStore, run_id: str, entry: RolloutEntry) -> None:
    """Replace the entry's newest reward by every reward of the rollout (in stream order)."""
    rewards = await _read_compacted(store, REWARD.format(run=run_id, rollout=entry.rollout_id))
    others = [(seq, e) for seq, e in entry.events if not isinstance(e, RewardReported)]
    entry.events = list(heapq.merge(others, [(s.seq, s.event) for s in rewards], key=lambda pair: pair[0]))


def _compact(event: AnyEvent) -> AnyEvent:
    """A `RolloutCreated` without its input and config, its metadata cut to the step (what the index reads).

    The index keeps every rollout's small events; a created event's input can be a whole task.
    """
    if isinstance(event, RolloutCreated) and (event.input is not None or event.metadata or event.config):
        step = _step_of(event.metadata)
        return msgspec.structs.replace(event, input=None, metadata={} if step is None else {"step": step}, config={})
    return event


def _stale_limit(record: Mapping[str, Any]) -> tuple[int, int] | None:
    version, limit = record.get("weights_version"), record.get("max_staleness")
    if isinstance(version, int) and isinstance(limit, int):
        return version, limit
    return None


def _step_of(record: Mapping[str, Any]) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


async def index_run(
    store: EventStore, run_id: str, *, nats_url: str = "", counts: Mapping[str, int] | None = None
) -> RunIndex:
    """Pass 1: the run's rollouts from its small events and per-subject call counts (`call_counts`,
    read here unless given).

    Raises `RunNotFound` when the run has no event on the stream at all.
    """
    check_id("run_id", run_id)
    if not await run_exists(store, run_id):
        where = f" at {nats_url}" if nats_url else ""
        raise RunNotFound(f"run {run_id!r} has no events on the stream{where}; `rollwire runs` lists the runs")
    rollouts: dict[str, RolloutEntry] = {}
    recorded: dict[str, Any] | None = None
    has_steps = False
    for stored in await _small_events(store, run_id):
        event = stored.event
        if isinstance(event, RunStarted):
            recorded = _spec_selection(event, recorded)
            continue
        if event.rollout_id is None:
            continue
        entry = rollouts.get(event.rollout_id)
        if entry is None:
            entry = rollouts[event.rollout_id] = RolloutEntry(rollout_id=event.rollout_id, order=stored.seq, events=[])
        if isinstance(event, CustomEvent):  # a trainer step record (one an agent wrote is not)
            if not event.trusted:
                continue
            step = _step_of(event.payload)
            if step is not None:
                entry.step, has_steps = step, True
                entry.stale_limit = _stale_limit(event.payload)
            adapter = event.payload.get("adapter")
            if isinstance(adapter, Mapping):
                recorded = dict(adapter)
            continue
        if isinstance(event, RolloutCreated):
            entry.group_id = event.group_id
            entry.declared_step = _step_of(event.metadata)
        entry.events.append((stored.seq, event))
    await _add_attempts(store, run_id, rollouts)
    await asyncio.gather(
        *(_all_rewards(store, run_id, entry) for entry in rollouts.values() if _other_attempts_reward(entry))
    )
    if counts is None:
        counts = await call_counts(store, run_id)
    for subject, count in counts.items():
        rollout_id = subject.split(".")[3]
        entry = rollouts.get(rollout_id)
        if entry is None:  # calls without any indexed event: the adapter skips it as not created
            entry = rollouts[rollout_id] = RolloutEntry(rollout_id=rollout_id, order=1 << 62, events=[])
        entry.calls = count
    has_steps = _mark_skips(rollouts, has_steps)
    return RunIndex(run_id=run_id, rollouts=rollouts, recorded_adapter=recorded, has_steps=has_steps)


def _mark_skips(rollouts: Mapping[str, RolloutEntry], has_steps: bool) -> bool:
    """Set each rollout's `skip`: not trainable, or (in a run with steps) in no step. Whether the run
    has steps: the trainer's step records, or else the steps its rollouts declared when created."""
    for entry in rollouts.values():
        try:
            rollout_calls(e for _, e in entry.events)
        except NotTrainable as exc:
            entry.skip = exc.reason
    if not has_steps and any(e.declared_step is not None for e in rollouts.values()):
        for entry in rollouts.values():
            entry.step = entry.declared_step
        has_steps = True
    if has_steps:
        for entry in rollouts.values():
            if entry.skip is None and entry.step is None:
                entry.skip = "not-in-a-step"
    return has_steps


def _spec_selection(event: RunStarted, recorded: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run spec's declared selection (`train_agents`, `train_models`) under the recorded adapter config
    (a run whose stored spec is invalid declares none)."""
    try:
        spec = spec_of(event)
    except InvalidRunSpec:
        return recorded
    selection = {
        key: list(names) for key, names in (("agents", spec.train_agents), ("models", spec.train_models)) if names
    }
    if not selection:
        return recorded
    return {**selection, **(recorded or {})}


def plan_units(index: RunIndex, step: int | None = None) -> list[Unit]:
    """The replay units (step, group) in run order; only `step` when given.

    Raises `ReplayError` when `step` is given and no rollout of the run was trained in it.
    """
    if step is not None:
        if not index.has_steps:
            raise ReplayError(
                f"run {index.run_id!r} has no trainer step records ({TRAIN_STEP_EVENT} events or a step in the "
                "rollouts' metadata); replay it without --step"
            )
        if step not in index.steps:
            steps = index.steps
            raise ReplayError(
                f"run {index.run_id!r} has no trainer step {step}; its steps are {steps[0]}..{steps[-1]}"
                if steps
                else f"run {index.run_id!r} has no trained rollouts"
            )
    units: dict[tuple[Any, ...], list[RolloutEntry]] = {}
    trainable = sorted((e for e in index.rollouts.values() if e.skip is None), key=lambda e: e.order)
    for entry in trainable:
        if step is not None and entry.step != step:
            continue
        group: tuple[Any, ...] = ("g", entry.group_id) if entry.group_id is not None else ("r", entry.rollout_id)
        units.setdefault((entry.step, *group), []).append(entry)
    return [
        Unit(
            step=entries[0].step,
            group_id=entries[0].group_id,
            rollout_ids=[e.rollout_id for e in entries],
            calls=sum(e.calls for e in entries),
            stale_limit=entries[0].stale_limit,  # one step: one train_step record for all its rollouts
        )
        for entries in units.values()
    ]


class UnitInput(msgspec.Struct, frozen=True, kw_only=True):
    """A unit with its rollouts' indexed events and raw calls: all a worker needs to replay it."""

    unit: Unit
    histories: list[tuple[list[tuple[int, AnyEvent]], list[tuple[int, bytes]]]]
    """Per rollout of the unit: its small events and its calls' (sequence, JSON bytes), both in stream order."""


def unit_rollouts(item: UnitInput, select: Selection | None = None) -> tuple[list[RolloutCalls], dict[str, str]]:
    """Decode a unit's calls and give each rollout's history to the adapter's `rollout_calls`.

    A rollout with a call that cannot be trained on (no token ids, missing logprobs) is skipped as
    `malformed-call`, as the trainer skips it; the second value maps such rollouts to the reason.
    """
    rollouts = []
    skipped: dict[str, str] = {}
    for rollout_id, (small, raw) in zip(item.unit.rollout_ids, item.histories, strict=True):
        # Both lists are in stream order: sorting their concatenation merges two runs, in C.
        merged = sorted([*small, *[(seq, decode_call(data)) for seq, data in raw]], key=_by_sequence)
        try:
            rollout = rollout_calls([event for _, event in merged], select)
        except MalformedCall:
            skipped[rollout_id] = "malformed-call"
            continue
        rollouts.append(rollout)
    if item.unit.stale_limit is not None:
        rollouts, _ = drop_stale_calls(rollouts, *item.unit.stale_limit)
    return rollouts, skipped


async def stream_chunks(
    store: EventStore, index: RunIndex, units: list[Unit], *, budget: int = CALL_BUDGET
) -> AsyncIterator[list[UnitInput]]:
    """Pass 2, raw: units with their calls' bytes, in batches of about `budget` calls.

    One sequential read of the run's `model_request` subjects from the first planned rollout's creation on: each
    call's bytes are kept only until its unit is complete (the index knows how many calls every rollout has), then
    the unit is handed on and forgotten. Memory is bounded by the units whose rollouts overlap in the stream (the
    groups that ran at the same time), not by the run; the read stops at the last planned call. Units come in the
    order they complete; the accumulators restore run order."""
    remaining: dict[str, int] = {}
    unit_of: dict[str, int] = {}
    incomplete: dict[int, int] = {}
    raw: dict[str, list[tuple[int, bytes]]] = {}
    ready: list[UnitInput] = []
    ready_calls = 0

    def complete(i: int) -> None:
        nonlocal ready_calls
        unit = units[i]
        histories = [(index.rollouts[rid].events, raw.pop(rid, [])) for rid in unit.rollout_ids]
        ready.append(UnitInput(unit=unit, histories=histories))
        ready_calls += unit.calls

    for i, unit in enumerate(units):
        waiting = [rid for rid in unit.rollout_ids if index.rollouts[rid].calls]
        for rid in waiting:
            remaining[rid], unit_of[rid], raw[rid] = index.rollouts[rid].calls, i, []
        if waiting:
            incomplete[i] = len(waiting)
        else:
            complete(i)
    if remaining:
        start = min(index.rollouts[rid].order for rid in remaining)
        subject = MODEL_REQUEST.format(run=index.run_id, rollout="*")
        async for batch in store.read_raw(subject, after_seq=max(0, start - 1)):
            for msg in batch:
                rid = msg.subject.split(".", 4)[3]
                left = remaining.get(rid)
                if left is None:  # a rollout outside the planned units (skipped, or another step)
                    continue
                raw[rid].append((stream_sequence(msg.reply), msg.data))
                if left > 1:
                    remaining[rid] = left - 1
                    continue
                del remaining[rid]
                i = unit_of[rid]
                incomplete[i] -= 1
                if not incomplete[i]:
                    del incomplete[i]
                    complete(i)
            if ready_calls >= budget:
                yield ready
                ready, ready_calls = [], 0
            if not remaining:
                break
    for i in sorted(incomplete):  # fewer calls than counted (purged meanwhile): what there is
        complete(i)
    if ready:
        yield ready
