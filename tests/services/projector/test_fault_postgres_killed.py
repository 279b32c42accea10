"""Fault: Postgres killed (SIGKILL) under write load behind a gateway with the Postgres read side.

Expected: writes through the gateway are unaffected (they go to the stream), reads answer 503
saying what is down (and the gateway's /healthz is 503), and once Postgres is back the projector
catches up unattended and the projection equals the fold of the stream.

The outage lasts `OUTAGE_S` = 8 s rather than the 30 s of the original probe: what changes with
the length of an outage is only how many retries happen, and 8 s already spans the reader's
connect timeout (3 s) and the projector's backoff cap (5 s), so every path a 30 s outage takes
is taken; the test stays short enough for CI.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import httpx
import pytest
from projector_reference import assert_projection, fold, stream_messages
from projector_support import gateway_with_projector, running_projector, wait_applied

from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer, PostgresServer, free_port
from services.projector.migrate import migrate
from services.projector.reader import PostgresRolloutReader

ADMIN = "pg-fault-admin"
OUTAGE_S = 8.0


@pytest.mark.slow
async def test_postgres_killed_writes_go_on_reads_503_projection_catches_up(
    fresh_nats: NatsServer, tmp_path: Path
) -> None:
    pg = PostgresServer(tmp_path / "pg", port=free_port()).start()
    try:
        conn = await asyncpg.connect(pg.url)
        await migrate(conn)
        await conn.close()
        writes: list[int] = []
        async with running_projector(fresh_nats.url, pg.url, metrics_port=-1, max_backoff_s=5.0):
            with gateway_with_projector(
                fresh_nats.url, pg.url, ADMIN, min_seq_timeout_s=1.0, connect_timeout=1.0
            ) as server:
                auth = {"Authorization": f"Bearer {ADMIN}"}
                async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=30) as client:

                    async def write(i: int) -> None:
                        batch = {"rollouts": [{"run_id": "pgk", "input": {"i": i}, "group_id": f"g{i % 5}"}]}
                        r = await client.post("/api/rollouts", json=batch)
                        writes.append(r.status_code)

                    for i in range(20):
                        await write(i)
                    assert pg.proc is not None
                    pg.kill()
                    killed = time.monotonic()
                    reads: list[int] = []
                    bodies: list[str] = []
                    i = 20
                    while time.monotonic() - killed < OUTAGE_S:
                        await write(i)
                        i += 1
                        read = await client.get("/api/rollouts", params={"run_id": "pgk"})
                        reads.append(read.status_code)
                        bodies.append(read.text)
                        await asyncio.sleep(0.1)
                    health = await client.get("/healthz")
                    pg.start()
                    restarted = time.monotonic()
                    while (
                        await client.get("/api/rollouts", params={"run_id": "pgk", "limit": 1000})
                    ).status_code != 200:
                        assert time.monotonic() - restarted < 60, "reads never came back"
                        await asyncio.sleep(0.2)
                    store = await EventStore.connect(fresh_nats.url)
                    last = await store.last_sequence()
                    conn = await asyncpg.connect(pg.url)
                    await wait_applied(conn, last, timeout=60)
                    caught_up = time.monotonic() - restarted
                    listed = (await client.get("/api/rollouts", params={"run_id": "pgk", "limit": 1000})).json()
        reader2 = PostgresRolloutReader(pg.url)
        await assert_projection(conn, reader2, fold(await stream_messages(store)))
        await reader2.close()
        await conn.close()
        await store.close()
    finally:
        pg.stop()
    print(
        f"\nPostgres killed for {OUTAGE_S:g}s: {len(writes)} writes, {writes.count(201)} answered 201; "
        f"reads during the outage {sorted(set(reads))}; projection caught up {caught_up:.1f}s after the restart"
    )
    assert writes.count(201) == len(writes) == i
    assert set(reads) == {503} and all("Errno" not in b and "writes still work" in b for b in bodies)
    assert health.status_code == 503 and health.json()["reads"] is False
    assert len(listed) == i
