"""Numbers out of range (issue: a reward step of 3e9 stopped the projector for good).

An event already on the stream with an integer Postgres cannot hold (written before the contract
bounded it, or by a writer that bypassed it) is a poison event: it goes to the dead letters and the
projection moves on. A lost connection stays a temporary failure. A read of a sequence no stream
reaches is a 404, not a 500.
"""

from __future__ import annotations

import asyncpg
import httpx
import msgspec
from projector_scenarios import load_events
from projector_support import ServerThread, running_projector, wait_applied

from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.projector.api import create_query_app
from services.projector.pgstore import is_poison
from services.projector.reader import PostgresRolloutReader

BIG = 3_000_000_000


async def test_out_of_range_integers_become_dead_letters(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection
) -> None:
    store = await EventStore.connect(fresh_nats.url)
    try:
        events = load_events("big", 2, seed=3)
        await store.append_many(events[:5])
        rollout = events[0].rollout_id
        raw = [
            (
                f"rl.big.rollout.{rollout}.reward",
                {
                    "type": "reward",
                    "run_id": "big",
                    "rollout_id": rollout,
                    "event_id": "bigstep",
                    "value": 1.0,
                    "step": BIG,
                },
            ),
            (
                "rl.big.phase",
                {"type": "phase", "run_id": "big", "event_id": "bigphase", "phase": "rollout", "weights_version": BIG},
            ),
            (
                "rl.big.model.m",
                {
                    "type": "model.registered",
                    "run_id": "big",
                    "event_id": "bigmodel",
                    "name": "m",
                    "base_url": "http://127.0.0.1:1/v1",
                    "weights_version": BIG,
                },
            ),
        ]
        for subject, body in raw:  # as an older writer would have published them
            await store.js.publish(subject, msgspec.json.encode(body), stream=store.stream)
        last = (await store.append_many(events[5:]))[-1].seq
        async with running_projector(fresh_nats.url, database, metrics_port=-1) as projector:
            await wait_applied(conn, last, timeout=20.0)
            assert projector.status.dead_letters == 3
        dead = await conn.fetch("SELECT seq, subject FROM dead_letters ORDER BY seq")
        assert [row["subject"] for row in dead] == [subject for subject, _ in raw]
    finally:
        await store.close()


async def test_poison_is_told_from_a_lost_connection(database: str) -> None:
    live = await asyncpg.connect(database)
    try:
        assert is_poison(OverflowError("value out of int32 range"), live)
        assert is_poison(asyncpg.DataError("invalid input for query argument $1"), live)
        assert not is_poison(ConnectionResetError("reset by peer"), live)
        assert not is_poison(TimeoutError(), live)
    finally:
        await live.close()
    assert not is_poison(OverflowError("value out of int32 range"), live)  # the connection is gone: retry


async def test_a_call_seq_no_stream_reaches_is_a_404_not_a_500(database: str) -> None:
    """`/ui/api/calls/{seq}` with seq at or past 2^63 (Postgres' bigint) once answered 500."""
    app = create_query_app(PostgresRolloutReader(database), admin_token="bounds-admin")
    with ServerThread(app) as projector:
        async with httpx.AsyncClient(base_url=projector.url, headers={"Authorization": "Bearer bounds-admin"}) as c:
            for seq in (2**63, 2**64, 10**30, 2**53):
                answer = await c.get(f"/ui/api/calls/{seq}")
                assert answer.status_code == 404, (seq, answer.text)
            past = await c.get("/ui/api/calls/1", params={"seq": 2**63})
            assert past.status_code == 422 and "seq" in past.json()["error"], past.text
