"""The projector service against real NATS and Postgres: poison, Postgres outages, read-your-writes,
pagination under concurrent inserts, rebuilds, metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import asyncpg
import httpx
import msgspec
import pytest
from projector_reference import assert_projection, fold, stream_messages
from projector_scenarios import StreamBuilder, load_events
from projector_support import ServerThread, running_projector, wait_applied

from schemas import CustomEvent, Event, ModelRequestRecorded, RolloutCreated
from services.common.eventstore import EventStore
from services.common.readside import RolloutQuery
from services.devstack.embedded import NatsServer, PostgresServer
from services.projector.api import create_query_app
from services.projector.cli import _rebuild
from services.projector.reader import PostgresRolloutReader, ProjectionBehind
from services.projector.rebuild import rebuild_run


@contextlib.asynccontextmanager
async def _store(url: str) -> AsyncIterator[EventStore]:
    store = await EventStore.connect(url)
    try:
        yield store
    finally:
        await store.close()


async def test_poison_goes_to_dead_letters_and_projection_goes_on(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection, reader: PostgresRolloutReader
) -> None:
    async with _store(fresh_nats.url) as store:
        events = load_events("p", 3, seed=1)
        await store.append_many(events[:10])
        await store.js.publish("rl.p.rollout.ro0.event.junk", b"\x00 not json at all")
        bad = CustomEvent(run_id="p", rollout_id="ro0", name="tool", payload={"text": "a\u0000b"})
        await store.append(bad)  # valid JSON Postgres refuses (NUL in jsonb)
        last = (await store.append_many(events[10:]))[-1].seq
        async with running_projector(fresh_nats.url, database, metrics_port=0) as projector:
            await wait_applied(conn, last)
            with ServerThread(create_query_app(reader, status=projector.status)) as server:
                async with httpx.AsyncClient(base_url=server.url) as client:
                    health = (await client.get("/healthz")).json()
                    metrics = (await client.get("/metrics")).text
        dead = await conn.fetch("SELECT seq, reason FROM dead_letters ORDER BY seq")
        assert [row["seq"] for row in dead] == [11, 12]
        assert "undecodable" in dead[0]["reason"] and "rejected by Postgres" in dead[1]["reason"]
        assert health["dead_letters"] == 2 and health["applied_seq"] == last and health["status"] == "ok"
        assert f'rollwire_projector_applied_seq{{stream="ROLLWIRE"}} {last}.0' in metrics
        assert "rollwire_projector_lag_seconds" in metrics
        await assert_projection(conn, reader, fold(await stream_messages(store)))


async def test_postgres_stopped_and_restarted_mid_load(fresh_nats: NatsServer, tmp_path: Path) -> None:
    pg = PostgresServer(tmp_path / "pg", durable=False).start()
    try:
        events = load_events("pg", 40, seed=2)
        async with _store(fresh_nats.url) as store:
            await store.append_many(events[:100])
            async with running_projector(fresh_nats.url, pg.url, batch_size=20) as projector:
                conn = await asyncpg.connect(pg.url)
                await wait_applied(conn, 100)
                await conn.close()
                publisher = asyncio.create_task(_publish_slowly(store, events[100:], per_batch=20, pause=0.05))
                await asyncio.sleep(0.2)
                pg.stop()
                await asyncio.sleep(1.5)
                assert not projector.status.postgres_up
                stored_before = projector.status.applied_seq
                acked = (await store.js.consumer_info("ROLLWIRE", "rollwire-projector")).ack_floor.stream_seq
                assert acked <= stored_before, "acknowledged messages that were not stored"
                pg.start()
                await publisher
                conn = await asyncpg.connect(pg.url)
                await wait_applied(conn, len(events))
            reader = PostgresRolloutReader(pg.url)
            await assert_projection(conn, reader, fold(await stream_messages(store)))
            await reader.close()
            await conn.close()
    finally:
        pg.stop()


async def _publish_slowly(store: EventStore, events: Sequence[Event], per_batch: int, pause: float) -> None:
    for start in range(0, len(events), per_batch):
        await store.append_many(events[start : start + per_batch])
        await asyncio.sleep(pause)


async def test_min_seq_read_your_writes(fresh_nats: NatsServer, database: str, reader: PostgresRolloutReader) -> None:
    async with _store(fresh_nats.url) as store:
        async with running_projector(fresh_nats.url, database):
            for index in range(5):
                ack = await store.append(RolloutCreated(run_id="rw", rollout_id=f"x{index}", input=index))
                assert await reader.wait_for(ack.seq, timeout=10.0) >= ack.seq
                view = await reader.get(f"x{index}")
                assert view is not None and view.input == index
        ack = await store.append(RolloutCreated(run_id="rw", rollout_id="late", input="x"))
        with pytest.raises(ProjectionBehind) as behind:
            await reader.wait_for(ack.seq, timeout=0.3)
        assert behind.value.applied == ack.seq - 1
        assert await reader.get("late") is None


async def test_pagination_is_stable_under_concurrent_inserts(
    fresh_nats: NatsServer, database: str, reader: PostgresRolloutReader
) -> None:
    builder = StreamBuilder(prefix="pg-")
    created = [RolloutCreated(**builder.envelope("pg", f"x{i}"), input=i) for i in range(120)]
    async with _store(fresh_nats.url) as store:
        await store.append_many(created[:40])
        async with running_projector(fresh_nats.url, database):
            await reader.wait_for(40, timeout=10)
            publisher = asyncio.create_task(_publish_slowly(store, created[40:], per_batch=5, pause=0.02))
            seen: list[int] = []
            cursor = 0
            while True:
                page = await reader.query(RolloutQuery(run_id="pg", limit=7, cursor=cursor))
                if not page:
                    if publisher.done():
                        await reader.wait_for(len(created), timeout=10)
                        page = await reader.query(RolloutQuery(run_id="pg", limit=7, cursor=cursor))
                        if not page:
                            break
                    else:
                        await asyncio.sleep(0.01)
                        continue
                seen += [view.input for view in page]
                cursor = page[-1].created_seq
            await publisher
    assert seen == list(range(120)), "a page skipped or repeated a rollout"


async def test_rebuild_all_and_one_run(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection, reader: PostgresRolloutReader
) -> None:
    async with _store(fresh_nats.url) as store:
        await store.append_many(load_events("ra", 6, seed=3) + load_events("rb", 6, seed=4))
        last = await store.last_sequence()
        async with running_projector(fresh_nats.url, database):
            await wait_applied(conn, last)
            expected = fold(await stream_messages(store))
            await conn.execute("UPDATE rollouts SET calls = 999, reward = -1 WHERE run_id = 'rb'")
            await conn.execute("DELETE FROM events WHERE run_id = 'rb' AND type = 'reward'")
            folded = await rebuild_run(conn, store, "ROLLWIRE", "rb")
            assert folded == expected.runs["rb"]["events"]
            await assert_projection(conn, reader, expected)
        await conn.execute("UPDATE rollouts SET calls = 999")
        message = await _rebuild(fresh_nats.url, database, "ROLLWIRE", None)
        assert f"up to seq {last}" in message
        await assert_projection(conn, reader, expected)


async def test_a_call_with_a_nul_character_is_stored_escaped(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection
) -> None:
    """Postgres refuses NUL in text and jsonb: the call is kept, the NUL shown as the text `\\u0000`."""
    async with _store(fresh_nats.url) as store:
        await store.append(RolloutCreated(run_id="n", rollout_id="ro0", input={}))
        call = ModelRequestRecorded(
            run_id="n", rollout_id="ro0", attempt_id="a1", call_id="c1", prompt_ids=[1, 2], response_ids=[0, 3],
            logprobs=[-0.1, -0.2], request={"messages": [{"role": "user", "content": "say \u0000"}]},
            response={"message": {"role": "assistant", "content": "a\u0000b \\u0000"}},
        )  # fmt: skip
        last = (await store.append(call)).seq
        async with running_projector(fresh_nats.url, database, metrics_port=0):
            await wait_applied(conn, last)
        assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
        row = await conn.fetchrow("SELECT request, response FROM model_calls WHERE call_id = 'c1'")
        response = msgspec.json.decode(row["response"])
        assert response["message"]["content"] == "a\\u0000b \\u0000"  # the NUL escaped; a literal `\u0000` kept
        assert msgspec.json.decode(row["request"])["messages"][0]["content"] == "say \\u0000"
