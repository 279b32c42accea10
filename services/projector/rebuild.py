"""Dropping and rebuilding read models from the stream (`rollwire projector rebuild`).

A full rebuild empties every read-model table and sets the stored position to 0 in one
transaction; the projector notices its position moved and projects the stream again from the
start (if none is running, the command projects itself until caught up). Readers see empty
tables fill up again.

A run rebuild (`--run RUN`) re-folds one run in a single transaction that holds the position
row: it deletes the run's rows and folds the run's events up to the applied position again, so
readers see either the old rows or the new ones, and the running projector simply waits.
"""

from __future__ import annotations

import asyncpg

from schemas import check_id
from schemas.ids import RUN_ALL
from services.common.eventstore import EventStore
from services.projector import pgstore
from services.projector.fold import fold_batch
from services.projector.incoming import Incoming, prepare
from services.projector.refs import RefCache
from services.projector.tokens import Detokenizer

READ_TABLES = (
    "events",
    "model_calls",
    "rewards",
    "custom_events",
    "phases",
    "models",
    "rollouts",
    "attempts",
    "attempt_stats",
    "sample_chains",
    "runs",
    "dead_letters",
)
RUN_TABLES = tuple(t for t in READ_TABLES if t != "dead_letters")
CHUNK = 1000


async def reset(conn: asyncpg.Connection, stream: str) -> None:
    """Empty every read model and move the position of `stream` back to 0, atomically."""
    async with conn.transaction():
        await pgstore.ensure_position(conn, stream)
        await conn.execute("SELECT last_seq FROM projector_position WHERE stream = $1 FOR UPDATE", stream)
        await conn.execute(f"TRUNCATE {', '.join(READ_TABLES)}")
        await conn.execute("UPDATE projector_position SET last_seq = 0, updated_at = now() WHERE stream = $1", stream)
        await conn.execute("SELECT pg_notify($1, $2)", pgstore.NOTIFY_CHANNEL, f"{stream}:0")


async def _fold_chunk(conn: asyncpg.Connection, items: list[Incoming]) -> None:
    plan = fold_batch(items, await pgstore.load(conn, items))
    await pgstore.write(conn, plan)


async def rebuild_run(
    conn: asyncpg.Connection, store: EventStore, stream: str, run_id: str, detok: Detokenizer | None = None
) -> int:
    """Re-fold one run's rows from the stream up to the applied position; returns the events folded."""
    check_id("run_id", run_id)
    folded = 0
    async with conn.transaction():
        applied = await pgstore.ensure_position(conn, stream)
        await conn.execute("SELECT last_seq FROM projector_position WHERE stream = $1 FOR UPDATE", stream)
        for table in RUN_TABLES:
            await conn.execute(f"DELETE FROM {table} WHERE run_id = $1", run_id)
        pending: list[Incoming] = []
        refs = RefCache()  # the run's calls are read in stream order: every referenced call comes first
        reading = store.read_raw(RUN_ALL.format(run=run_id))
        async for msgs in reading:
            # Poison messages keep their dead letters; everything past the position is the projector's.
            pending += [item for item in prepare(msgs, detok, refs=refs) if item.seq <= applied and item.error is None]
            if len(pending) >= CHUNK:
                await _fold_chunk(conn, pending)
                folded += len(pending)
                pending = []
            if msgs and msgs[-1].metadata.sequence.stream >= applied:
                break
        await reading.aclose()  # type: ignore[attr-defined]  # an async generator
        if pending:
            await _fold_chunk(conn, pending)
            folded += len(pending)
    return folded
