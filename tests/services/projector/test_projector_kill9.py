"""kill -9 of the projector process at random points under load, 10 times: nothing lost, nothing twice.

Each round forks a projector process (the modules are already imported, so a round is short),
lets it project while a publisher keeps appending, and SIGKILLs it after a random delay: in the
middle of a fetch, a fold, a COPY, a commit or an ack. After the last round a projector catches up
and Postgres must equal the fold of the stream.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time

import asyncpg
import pytest
from projector_reference import assert_projection, fold, stream_messages
from projector_scenarios import load_events
from projector_support import running_projector, wait_applied

from schemas import Event
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.projector.reader import PostgresRolloutReader
from services.projector.service import Projector, ProjectorSettings

ROUNDS = 10
SEED = int(os.environ.get("ROLLWIRE_KILL9_SEED", "424242"))


def _project_forever(nats_url: str, database_url: str) -> None:
    settings = ProjectorSettings(nats_url=nats_url, database_url=database_url, batch_size=40)
    asyncio.run(Projector(settings).run())


async def _publish(store: EventStore, events: list[Event], stop: asyncio.Event) -> int:
    """Append a few events every 20 ms (about 300 events/s) until stopped."""
    sent = 0
    while sent < len(events) and not stop.is_set():
        await store.append_many(events[sent : sent + 6])
        sent += 6
        await asyncio.sleep(0.02)
    return min(sent, len(events))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork() to start projector processes quickly")
async def test_kill_9_at_random_points(fresh_nats: NatsServer, database: str) -> None:
    rng = random.Random(SEED)
    print(f"kill -9 schedule seed: {SEED} (set ROLLWIRE_KILL9_SEED to replay)")
    fork = multiprocessing.get_context("fork")
    store = await EventStore.connect(fresh_nats.url)
    conn = await asyncpg.connect(database)
    events = load_events("k9", 400, seed=SEED)
    stop = asyncio.Event()
    publisher = asyncio.create_task(_publish(store, events, stop))
    kills_after_progress = kills_under_load = 0
    try:
        for _ in range(ROUNDS):
            before = await conn.fetchval("SELECT coalesce(max(last_seq), 0) FROM projector_position")
            proc = fork.Process(target=_project_forever, args=(fresh_nats.url, database), daemon=True)
            proc.start()
            early = rng.random() < 0.1  # now and then, kill it while it is still starting
            deadline = time.monotonic() + 10.0
            while not early and time.monotonic() < deadline:
                now = await conn.fetchval("SELECT coalesce(max(last_seq), 0) FROM projector_position")
                if now > before:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(rng.uniform(0.0, 0.25))
            kills_after_progress += (
                await conn.fetchval("SELECT coalesce(max(last_seq), 0) FROM projector_position") > before
            )
            kills_under_load += not publisher.done()
            proc.kill()
            proc.join(5)
            assert proc.exitcode == -9
        stop.set()
        await publisher
        last = await store.last_sequence()
        async with running_projector(fresh_nats.url, database):
            await wait_applied(conn, last)
        reader = PostgresRolloutReader(database)
        try:
            await assert_projection(conn, reader, fold(await stream_messages(store)))
        finally:
            await reader.close()
        assert kills_after_progress >= ROUNDS // 2, "most kills should land while the projector works"
        assert kills_under_load == ROUNDS, "every kill should land while events are being appended"
    finally:
        stop.set()
        await conn.close()
        await store.close()
