"""One contract, two backends: the gateway's stream fold and the Postgres projection answer alike.

The same stream (every event type, rollouts of the same id in two runs, statuses in any order)
is read through `StreamRolloutReader` and, once projected, through `PostgresRolloutReader`;
every method of the `RolloutReader` protocol must give the same answer.
"""

from __future__ import annotations

import random

import asyncpg
from projector_scenarios import ROLLOUTS, RUNS, StreamBuilder, load_events, message, random_ops
from projector_support import running_projector, wait_applied

from services.common.eventstore import EventStore
from services.common.readside import RolloutQuery, StreamRolloutReader
from services.devstack.embedded import NatsServer
from services.projector.reader import PostgresRolloutReader

QUERIES = [
    RolloutQuery(),
    RolloutQuery(run_id="r0"),
    RolloutQuery(run_id="r1", limit=2),
    RolloutQuery(statuses=frozenset({"succeeded", "failed"})),
    RolloutQuery(statuses=frozenset({"queuing"}), run_id="lr"),
    RolloutQuery(group_id="g1"),
    RolloutQuery(group_id="g0", run_id="lr", mode="train"),
    RolloutQuery(mode="val"),
    RolloutQuery(run_id="lr", cursor=20, limit=5),
    RolloutQuery(limit=1, cursor=3),
]


async def test_stream_and_postgres_readers_agree(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection, reader: PostgresRolloutReader
) -> None:
    builder = StreamBuilder(seed=11)
    events = [builder.build(op) for op in random_ops(random.Random(11), 160)]
    store = await EventStore.connect(fresh_nats.url)
    try:
        for event in events:
            subject, data = message(event)
            await store.js.publish(subject, data)
        await store.append_many(load_events("lr", 8, seed=12))
        last = await store.last_sequence()
        async with running_projector(fresh_nats.url, database):
            await wait_applied(conn, last)
        stream = StreamRolloutReader(store)
        everything = await reader.query(RolloutQuery(limit=1000))
        assert len(everything) >= 10 and any(v.attempts for v in everything) and any(v.rewards for v in everything)
        assert any(v.terminal_seq for v in everything) and any(v.succeeded_attempt for v in everything)
        for run in (*RUNS, "lr"):
            rollouts = (*ROLLOUTS, "nope") if run != "lr" else tuple(f"ro{i}" for i in range(8))
            for rollout in rollouts:
                assert await reader.get(rollout, run) == await stream.get(rollout, run), (run, rollout)
                assert await reader.events(rollout, run) == await stream.events(rollout, run), (run, rollout)
            assert await reader.run(run) == await stream.run(run), run
        for rollout in (*ROLLOUTS, "ro3", "missing"):
            assert await reader.get(rollout) == await stream.get(rollout), rollout
        for query in QUERIES:
            assert await reader.query(query) == await stream.query(query), query
        for after, limit in ((0, 1000), (0, 3), (2, 4), (50, 10)):
            assert await reader.terminal(after, limit) == await stream.terminal(after, limit), (after, limit)
        assert await reader.run("never-started") is None
    finally:
        await store.close()
