"""Property: the contract's rollout fold (`schemas.rollout.fold`) is what every reader sees.

Any valid event sequence of a rollout (status changes the state machine allows, attempts,
rewards, model calls and custom events in between) folded event by event gives one state; the
same events, projected into Postgres in batches of any size and read back through the
projector's reader, give the same state; the controller's view is that state (without a finished
rollout's input); folding again, or redelivering a prefix, changes nothing; and no state folded
earlier is ever changed. The seed is pinned (`@seed`), so a failure replays exactly.
"""

from __future__ import annotations

import asyncio
from typing import cast

import asyncpg
import msgspec
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from schemas import (
    AnyEvent,
    AttemptStarted,
    CustomEvent,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    encode,
)
from schemas.events import RolloutStatus
from schemas.rollout import RolloutView, fold, fold_all
from schemas.transitions import ALLOWED
from services.common.eventstore import StoredEvent
from services.controller.view import compact
from services.projector import pgstore
from services.projector.incoming import prepare_one
from services.projector.reader import PostgresRolloutReader
from services.projector.rebuild import reset

RUN, RID, STREAM = "r1", "ro1", "FOLDPROP"


@st.composite
def rollout_events(draw: st.DrawFn) -> list[AnyEvent]:
    """A valid history of one rollout: a random walk over the status machine with events between."""
    t = 1000.0
    events: list[AnyEvent] = [RolloutCreated(run_id=RUN, rollout_id=RID, input={"q": 1}, max_attempts=3, time=t)]
    status: str | None = None
    attempt: str | None = None
    attempts = 0
    for _ in range(draw(st.integers(1, 12))):
        t += 1.0
        nxt = sorted(ALLOWED[status])
        if not nxt:
            break
        choice = draw(st.sampled_from([*nxt, "reward", "call", "custom"] if attempt else nxt))
        if choice == "reward":
            value = draw(st.floats(-1, 1, allow_nan=False))
            events.append(RewardReported(run_id=RUN, rollout_id=RID, attempt_id=attempt, value=value, time=t))
            continue
        if choice in ("call", "custom"):
            kind = ModelRequestRecorded if choice == "call" else CustomEvent
            extra = {"call_id": f"c{t:g}"} if choice == "call" else {"name": "note"}
            events.append(kind(run_id=RUN, rollout_id=RID, attempt_id=attempt, time=t, **extra))  # type: ignore[arg-type]
            continue
        if choice in ("preparing", "running") and status in ("queuing", "requeuing"):
            attempts += 1
            attempt = f"a{attempts}"
            started = AttemptStarted(run_id=RUN, rollout_id=RID, attempt_id=attempt, sequence=attempts, time=t)
            changed = RolloutStatusChanged(
                run_id=RUN, rollout_id=RID, attempt_id=attempt, status=cast(RolloutStatus, choice),
                previous=cast("RolloutStatus | None", status), time=t,
            )  # fmt: skip
            # The gateway writes the status first; a direct writer may write the attempt first.
            events.extend([changed, started] if draw(st.booleans()) else [started, changed])
        else:
            reason = "boom" if choice in ("failed", "requeuing") else None
            events.append(
                RolloutStatusChanged(
                    run_id=RUN, rollout_id=RID, attempt_id=attempt if choice != "queuing" else None,
                    status=cast(RolloutStatus, choice), previous=cast("RolloutStatus | None", status),
                    reason=reason, time=t,
                )
            )  # fmt: skip
        status = choice
    return events


def _stored(events: list[AnyEvent]) -> list[StoredEvent]:
    return [StoredEvent(seq=seq, subject=e.subject, event=e) for seq, e in enumerate(events, start=1)]


async def _project(url: str, stored: list[StoredEvent], batches: list[int]) -> RolloutView | None:
    items = [prepare_one(s.seq, s.subject, encode(s.event), 0.0, None) for s in stored]
    conn = await asyncpg.connect(url)
    reader = PostgresRolloutReader(url, stream=STREAM)
    try:
        await reset(conn, STREAM)
        position, step = 0, 0
        while position < len(items):
            size = batches[step % len(batches)]
            step += 1
            position = (
                await pgstore.apply_isolating(conn, STREAM, items[position : position + size], position)
            ).position
        return await reader.get(RID, RUN)
    finally:
        await reader.close()
        await conn.close()


@seed(20261203)
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(events=rollout_events(), batches=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_fold_equals_projection_and_controller_view(database: str, events: list[AnyEvent], batches: list[int]) -> None:
    stored = _stored(events)
    states: list[RolloutView | None] = []
    state: RolloutView | None = None
    for item in stored:
        state = fold(state, item)
        states.append(state)
    snapshots = [msgspec.json.encode(s) for s in states]
    assert state is not None and state == fold_all(stored)
    # Idempotent by stream sequence: a redelivered prefix, or the whole history again, is a no-op.
    assert fold_all([*stored, *stored]) == state
    assert fold_all([*stored[: len(stored) // 2], *stored]) == state
    # Immutable: folding on never changed a state handed out before.
    assert [msgspec.json.encode(s) for s in states] == snapshots
    # The controller's view is the same fold; it only drops a finished rollout's input.
    controller = compact(state)
    assert controller == (msgspec.structs.replace(state, input=None) if state.terminal else state)
    # The projection's rows, read back, are the same state.
    assert asyncio.run(_project(database, stored, batches)) == state
