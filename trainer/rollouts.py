"""Knowing when rollouts have ended, and replaying what they recorded.

`StatusWatch` follows the run's status subjects (`rl.<run>.rollout.*.status`) with one JetStream
subscription, started at a stream sequence taken before any rollout it waits for was declared, so
no status change can slip between declaring and watching. The trainer never polls rollouts one by
one: it awaits `wait_groups`, which wakes when status events arrive.

`replay_group` reads each ended rollout's whole history (`rl.<run>.rollout.<id>.>`) and turns it
into the adapter's input (`trainer.core.rollout_calls`). Calls are decoded as the adapter's
`CallRecord` (`rollout_history`): bodies skipped, packed arrays and references left for the
adapter, which reads them into arrays and resolves them in order, so no call's full prompt is
ever made into a Python list (a 120-turn rollout at 67k tokens: a quarter of the time of
`EventStore.read_rollout`, which resolves every call's full prompt and request as lists). Only
succeeded rollouts are trainable;
the others are counted. Agents may post `metrics` custom events (a flat object of numbers); their
values are collected so the trainer can report per-step means next to the reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable, Sequence

import msgspec
import nats.errors

from schemas import CustomEvent, Event, PhaseChanged, RolloutStatusChanged, decode
from schemas.calls import CallRecord, decode_call
from schemas.events import TERMINAL_STATUSES
from schemas.ids import MODEL_REQUEST, PHASE, ROLLOUT_ALL, ROLLOUT_STATUS, check_id
from services.common.eventstore import EventStore
from trainer.checkpoint import InFlightGroup
from trainer.core import MalformedCall, NotTrainable, RolloutCalls, Selection, rollout_calls

AGENT_METRICS_EVENT = "metrics"
RESUBSCRIBE_FOR_S = 300.0
"""How long a broken status subscription is taken up again before the run stops with its error."""
RESUBSCRIBE_WAIT_S = 1.0

log = logging.getLogger("rollwire.trainer")


class StatusWatch:
    """Terminal statuses of a run's rollouts, kept current by one subscription (see the module docstring)."""

    def __init__(self, store: EventStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.ended: dict[str, str] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    async def start(self, after_seq: int) -> None:
        """Begin following status events stored after `after_seq`."""
        ready = asyncio.Event()
        self._task = asyncio.create_task(self._follow(after_seq, ready), name=f"status-watch-{self.run_id}")
        await ready.wait()

    async def _follow(self, after_seq: int, ready: asyncio.Event) -> None:
        """Follow the status subjects; a subscription that breaks (NATS restarted, or too slow to answer
        for a while) is taken up again after the last event seen, for up to `RESUBSCRIBE_FOR_S`."""
        pattern = ROLLOUT_STATUS.format(run=self.run_id, rollout="*")
        loop = asyncio.get_running_loop()
        last, failing_since = after_seq, None
        while True:
            try:
                stream = self.store.subscribe(pattern, after_seq=last)
                ready.set()
                async for stored in stream:
                    last, failing_since = stored.seq, None
                    self._note(stored.event)
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, OSError) as exc:  # TimeoutError is an OSError
                if failing_since is None:
                    failing_since = loop.time()
                    log.warning("the status subscription broke (%s: %s); taking it up again", type(exc).__name__, exc)
                elif loop.time() - failing_since > RESUBSCRIBE_FOR_S:
                    return self._fail(exc, ready)
                await asyncio.sleep(RESUBSCRIBE_WAIT_S)
            except BaseException as exc:  # surfaced to the waiter instead of dying silently
                return self._fail(exc, ready)

    def _note(self, event: object) -> None:
        if isinstance(event, RolloutStatusChanged) and event.status in TERMINAL_STATUSES:
            if event.rollout_id is not None:
                self.ended[event.rollout_id] = event.status
                self._changed.set()

    def _fail(self, exc: BaseException, ready: asyncio.Event) -> None:
        self._error = exc
        self._changed.set()
        ready.set()

    async def adopt(self, rollout_ids: Iterable[str]) -> None:
        """Record the current status of rollouts declared before this watch started (a resumed run)."""
        for rollout_id in rollout_ids:
            status, _ = await self.store.last_status(self.run_id, rollout_id)
            if status is not None and status.status in TERMINAL_STATUSES:
                self.ended[rollout_id] = status.status
        self._changed.set()

    def group_ended(self, group: InFlightGroup) -> bool:
        """True when every rollout of the group has a terminal status."""
        return all(r in self.ended for r in group.rollout_ids)

    async def wait_groups(
        self, groups: Sequence[InFlightGroup], count: int, timeout_s: float | None = None
    ) -> list[InFlightGroup]:
        """Wait until at least `count` of `groups` have ended; return all that have, in declaration order."""
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        while True:
            if self._error is not None:
                raise RuntimeError(f"the status subscription stopped: {self._error}") from self._error
            done = [g for g in groups if self.group_ended(g)]
            if len(done) >= min(count, len(groups)):
                return done
            self._changed.clear()
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"{len(done)} of {len(groups)} groups ended; waited for {count}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):  # not wait_for: on 3.11 it can lose a cancel
                    await self._changed.wait()

    async def stop(self) -> None:
        """Stop following."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None


class ReplayedGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One ended group: its trainable rollouts, why the others were skipped, and agent metrics."""

    group: InFlightGroup
    rollouts: list[RolloutCalls]
    skipped: dict[str, str]
    agent_metrics: list[dict[str, float]]


def _agent_metrics(events: Sequence[object], attempt_id: str | None) -> dict[str, float]:
    """The last `metrics` custom event of the attempt, numbers only."""
    found: dict[str, float] = {}
    for event in events:
        if isinstance(event, CustomEvent) and event.name == AGENT_METRICS_EVENT:
            if attempt_id is None or event.attempt_id in (attempt_id, None):
                found = {
                    k: float(v)
                    for k, v in event.payload.items()
                    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
                }
    return found


async def rollout_history(store: EventStore, run_id: str, rollout_id: str) -> list[Event | CallRecord]:
    """A rollout's events in stream order, its calls as `CallRecord`s (see the module docstring)."""
    subject = ROLLOUT_ALL.format(run=check_id("run_id", run_id), rollout=check_id("rollout_id", rollout_id))
    calls = MODEL_REQUEST.format(run=run_id, rollout=rollout_id)
    history: list[Event | CallRecord] = []
    async for batch in store.read_raw(subject):
        history.extend(decode_call(msg.data) if msg.subject == calls else decode(msg.data) for msg in batch)
    return history


async def update_spans(store: EventStore, run_id: str) -> list[tuple[float, float]]:
    """`(began, ended)` of each of the run's update phases, from its phase events (one still open ends at
    infinity): the time the phase gate held new calls, which a timed-out attempt must not be blamed for."""
    spans: list[tuple[float, float]] = []
    began: float | None = None
    async for stored in store.read(PHASE.format(run=check_id("run_id", run_id))):
        event = stored.event
        if not isinstance(event, PhaseChanged):
            continue
        if event.phase == "update" and began is None:
            began = event.time
        elif event.phase == "rollout" and began is not None:
            spans.append((began, event.time))
            began = None
    if began is not None:
        spans.append((began, math.inf))
    return spans


async def replay_group(
    store: EventStore,
    run_id: str,
    group: InFlightGroup,
    select: Selection | None = None,
    updates: Sequence[tuple[float, float]] = (),
) -> ReplayedGroup:
    """Read every rollout of an ended group from the stream and extract its training calls (`select`ed);
    `updates` (`update_spans`) excuse a timeout that overlapped an update (async mode)."""
    rollouts: list[RolloutCalls] = []
    skipped: dict[str, str] = {}
    metrics: list[dict[str, float]] = []
    for rollout_id in group.rollout_ids:
        events = await rollout_history(store, run_id, rollout_id)
        try:
            calls = rollout_calls(events, select, updates)
        except NotTrainable as exc:
            skipped[rollout_id] = exc.reason
            continue
        except MalformedCall as exc:
            skipped[rollout_id] = f"malformed-call: {exc}"
            continue
        rollouts.append(calls)
        found = _agent_metrics(events, calls.attempt_id)
        if found:
            metrics.append(found)
    return ReplayedGroup(group=group, rollouts=rollouts, skipped=skipped, agent_metrics=metrics)
