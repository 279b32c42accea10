"""Property: after any batching, redelivery, lost batch and restart, Postgres equals a fold of the stream.

Messages go through the projector's own transactions exactly as the service sends them, in
batches hypothesis chooses: some redeliver already-applied messages with new ones, some are
"lost" (fetched, then the process dies before commit: the position decides what comes next), some
are followed by a restart (a new connection that reads the position), and some pairs go the
service's pipelined way: the second batch is folded against the first one's plan, on another
connection, before the first commits. The stream mixes every event type, poison messages and
values Postgres refuses (a NUL), which make a planned commit fail and fall back.
"""

from __future__ import annotations

import asyncio

import asyncpg
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from projector_reference import assert_projection, fold
from projector_scenarios import DELIVERY, OPS, StreamBuilder, message

from services.projector import pgstore
from services.projector.incoming import Incoming, prepare_one
from services.projector.reader import PostgresRolloutReader
from services.projector.rebuild import reset

STREAM = "PROPERTY"


async def _project(url: str, ops: list[tuple[object, ...]], deliveries: list[tuple[int, int, str]]) -> None:
    builder = StreamBuilder()
    messages = [(seq, *message(builder.build(op))) for seq, op in enumerate(ops, start=1)]
    items = [prepare_one(seq, subject, data, 0.0, None) for seq, subject, data in messages]
    conn = await asyncpg.connect(url)
    side = await asyncpg.connect(url)  # the connection the service folds ahead on
    reader = PostgresRolloutReader(url, stream=STREAM)
    try:
        await reset(conn, STREAM)
        position, step = 0, 0
        while position < len(items):
            size, redelivered, action = deliveries[step % len(deliveries)] if deliveries else (len(items), 0, "apply")
            step += 1
            if step > len(deliveries):  # the schedule ran out: deliver the rest at once
                size, action = len(items), "apply"
            batch = items[max(0, position - redelivered) : position + size]
            if action == "lost":
                continue
            if action == "pipelined":
                position = await _pipelined(conn, side, batch, items[position + size : position + 2 * size], position)
                continue
            position = (await pgstore.apply_isolating(conn, STREAM, batch, position)).position
            if action == "restart":
                await conn.close()
                conn = await asyncpg.connect(url)
                position = await pgstore.ensure_position(conn, STREAM)
        await assert_projection(conn, reader, fold(messages))
    finally:
        await reader.close()
        await conn.close()
        await side.close()


async def _pipelined(
    conn: asyncpg.Connection, side: asyncpg.Connection, first: list[Incoming], second: list[Incoming], position: int
) -> int:
    """The service's way: fold `second` against `first`'s plan before `first` commits."""
    plan = await pgstore.plan_batch(conn, first, position)
    ahead = await pgstore.plan_batch(side, second, plan.last_seq, plan) if plan is not None and second else None
    try:
        position = (await pgstore.commit(conn, STREAM, plan, position)).position if plan else position
    except asyncpg.PostgresError:  # refused data: fold again, isolating the event at fault
        return (await pgstore.apply_isolating(conn, STREAM, second, (await pgstore.apply_isolating(
            conn, STREAM, first, position)).position)).position  # fmt: skip
    if ahead is None:
        return (await pgstore.apply_isolating(conn, STREAM, second, position)).position
    try:
        return (await pgstore.commit(conn, STREAM, ahead, position)).position
    except asyncpg.PostgresError:
        return (await pgstore.apply_isolating(conn, STREAM, second, position)).position


@seed(20251202)
@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(OPS, min_size=15, max_size=50), deliveries=st.lists(DELIVERY, min_size=2, max_size=12))
def test_projection_equals_fold(
    database: str, ops: list[tuple[object, ...]], deliveries: list[tuple[int, int, str]]
) -> None:
    asyncio.run(_project(database, ops, deliveries))
