"""The gateway serving its GET endpoints from Postgres: read-your-writes with `min_seq`, run
summaries, the viewer, and a clear 503 when Postgres is away (while writes still work)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import asyncpg
import httpx
from projector_support import ServerThread, running_projector

from services.devstack.embedded import NatsServer, free_port
from services.gateway import GatewaySettings, create_app
from services.projector.api import create_query_app
from services.projector.reader import PostgresRolloutReader

ADMIN = "read-side-admin"


@contextlib.contextmanager
def gateway(nats_url: str, database_url: str) -> Iterator[ServerThread]:
    """The projector's query app over `database_url`, and a gateway that forwards its reads to it."""
    query = create_query_app(PostgresRolloutReader(database_url), admin_token=ADMIN, min_seq_timeout_s=1.0)
    with ServerThread(query) as projector:
        settings = GatewaySettings(
            nats_url=nats_url, admin_token=ADMIN, secret="s" * 32, port=free_port(), projector_url=projector.url
        )
        with ServerThread(create_app(settings)) as server:
            yield server


async def test_reads_come_from_postgres_and_see_their_writes(
    fresh_nats: NatsServer, database: str, conn: asyncpg.Connection
) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with gateway(fresh_nats.url, database) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=30) as client:
            async with running_projector(fresh_nats.url, database):
                started = await client.post("/api/runs", json={"run_id": "rw", "command": ["true"]})
                assert started.status_code == 201, started.text
                batch = [{"run_id": "rw", "rollout_id": f"r{i}", "input": {"i": i}, "group_id": "g"} for i in range(5)]
                created = await client.post("/api/rollouts", json={"rollouts": batch})
                assert created.status_code in (200, 201), created.text
                seq = created.json()["seq"]
                one = await client.get("/api/rollouts/r4", params={"min_seq": seq})
                assert one.status_code == 200 and one.json()["input"] == {"i": 4}
                page = await client.get("/api/rollouts", params={"run_id": "rw", "limit": 2, "min_seq": seq})
                assert [r["rollout_id"] for r in page.json()] == ["r0", "r1"]
                rest = await client.get(
                    "/api/rollouts", params={"run_id": "rw", "cursor": page.headers["x-next-cursor"]}
                )
                assert [r["rollout_id"] for r in rest.json()] == ["r2", "r3", "r4"]
                run = (await client.get("/api/runs/rw", params={"min_seq": seq})).json()
                assert run["rollouts"] == {"queuing": 5} and run["summary"]["rollouts"] == 5
                runs = (await client.get("/api/runs")).json()
                assert [r["run_id"] for r in runs["runs"]] == ["rw"] and runs["applied_seq"] >= seq
                assert (await client.get("/api/runs/rw/summary")).json()["by_status"] == {"queuing": 5}
                assert (await client.get("/ui/")).status_code == 200
                assert (await client.get("/ui/api/runs")).status_code == 200
                assert (await httpx.AsyncClient(base_url=server.url).get("/api/runs")).status_code == 401
            # The projector is stopped: a write is acknowledged, a read of it times out clearly.
            late = await client.post(
                "/api/rollouts", json={"rollouts": [{"run_id": "rw", "rollout_id": "late", "input": 1}]}
            )
            assert late.status_code == 201, late.text
            late_seq = late.json()["seq"]
            behind = await client.get("/api/rollouts/late", params={"min_seq": late_seq})
            assert behind.status_code == 503 and behind.json()["min_seq"] == late_seq
            assert behind.json()["applied_seq"] < late_seq and "Retry-After" in behind.headers


async def test_postgres_unreachable_is_a_clear_503_and_writes_still_work(fresh_nats: NatsServer) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with gateway(fresh_nats.url, f"postgresql://postgres@127.0.0.1:{free_port()}/none") as server:
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=30) as client:
            write = await client.post(
                "/api/rollouts", json={"rollouts": [{"run_id": "down", "rollout_id": "x", "input": 1}]}
            )
            assert write.status_code in (200, 201), write.text
            read = await client.get("/api/rollouts", params={"run_id": "down"})
            assert read.status_code == 503 and "read models (Postgres) cannot be reached" in read.json()["error"]
            assert "writes still work" in read.json()["error"]
            assert (await client.get("/api/runs")).status_code == 503


async def test_a_run_with_rollouts_but_never_declared_has_a_summary(fresh_nats: NatsServer, database: str) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with gateway(fresh_nats.url, database) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=30) as client:
            async with running_projector(fresh_nats.url, database):
                batch = [{"run_id": "undeclared", "rollout_id": f"u{i}", "input": i} for i in range(3)]
                created = await client.post("/api/rollouts", json={"rollouts": batch})
                assert created.status_code == 201, created.text
                seq = created.json()["seq"]
                listed = (await client.get("/api/runs", params={"min_seq": seq})).json()
                assert [r["run_id"] for r in listed["runs"]] == ["undeclared"]
                run = await client.get("/api/runs/undeclared", params={"min_seq": seq})
                assert run.status_code == 200, run.text
                body = run.json()
                assert body["spec"] == {} and body["started_at"] is None and body["rollouts"] == {"queuing": 3}
                assert body["summary"]["rollouts"] == 3 and body["summary"]["started"] is False
                assert (await client.get("/api/runs/nothing-here")).status_code == 404


async def test_a_run_summary_survives_rewards_near_the_largest_float(fresh_nats: NatsServer, database: str) -> None:
    """Two rewards of 1e308 (finite, accepted) would overflow a float sum: the summary's mean is 1e308, not a 500."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with gateway(fresh_nats.url, database) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=30) as client:
            async with running_projector(fresh_nats.url, database):
                batch = [{"run_id": "huge", "rollout_id": f"h{i}", "input": i} for i in range(2)]
                assert (await client.post("/api/rollouts", json={"rollouts": batch})).status_code == 201
                seq = 0
                for i in range(2):
                    attempt = (await client.post(f"/api/rollouts/h{i}/attempts", json={})).json()
                    posted = await client.post(
                        f"/api/rollouts/h{i}/attempt/{attempt['attempt_id']}/events",
                        json={"type": "reward", "value": 1e308},
                    )
                    assert posted.status_code in (200, 201), posted.text
                    seq = max(seq, posted.json().get("seq", 0))
                listed = await client.get("/api/runs", params={"min_seq": seq})
                assert listed.status_code == 200, listed.text
                (run,) = [r for r in listed.json()["runs"] if r["run_id"] == "huge"]
                assert run["rewarded"] == 2 and run["reward_mean"] == 1e308
