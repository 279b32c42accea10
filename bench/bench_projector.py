"""Projector benchmark: events/s projected vs a raw COPY of the same rows, and lag at a steady rate.

    .venv/bin/python bench/bench_projector.py [--rollouts 400] [--rate 1000] [--seconds 20]

Starts its own nats-server and Postgres (durable, as in production). The mix is realistic for
agent RL: each rollout is created, queued, started, runs ~8 model calls whose prompts grow to
~2k tokens (a conversation: each prompt extends the previous one), two tool-call custom events,
a reward and a final status, so model calls carry nearly all the bytes.

1. Throughput: publish the whole stream first, then time the projector from empty to caught
   up. Then COPY the very rows the projector wrote (read back from its tables) into empty
   tables of a second database on the same server: the floor any projection pays.
2. Lag: publish at a steady `--rate` events/s while the projector runs; each event's lag is the
   time from its publish to the commit that applied it (seen through the projector's
   NOTIFY), reported as p50/p99/max.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from schemas import (
    AttemptStarted,
    CustomEvent,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    RunStarted,
)
from services.common.eventstore import EventStore
from services.common.gctune import tune_gc
from services.common.settings import run_async as run
from services.devstack.embedded import NatsServer, PostgresServer, free_port
from services.projector.migrate import migrate
from services.projector.pgstore import NOTIFY_CHANNEL
from services.projector.service import Projector, ProjectorSettings

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the of and to in is that for it as with was on be by this are or from at an file test def return".split()
TABLES = ("events", "model_calls", "rewards", "custom_events", "rollouts", "attempts", "attempt_stats", "sample_chains")


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def rollout_events(
    rng: random.Random, run_id: str, index: int, calls: int = 8, prompt_tokens: int = 2000
) -> list[Event]:
    """One rollout's events: a growing conversation of `calls` calls ending near `prompt_tokens`."""
    rid, aid = f"ro{index}", f"at{index}"
    events: list[Event] = [
        RolloutCreated(run_id=run_id, rollout_id=rid, input={"task": _text(rng, 60)}, group_id=f"g{index // 8}"),
        RolloutStatusChanged(run_id=run_id, rollout_id=rid, status="queuing"),
        AttemptStarted(run_id=run_id, rollout_id=rid, attempt_id=aid, sequence=1),
        RolloutStatusChanged(run_id=run_id, rollout_id=rid, attempt_id=aid, status="running", previous="queuing"),
    ]
    prompt = [rng.randrange(100, 50_000) for _ in range(prompt_tokens // 2)]
    step = (prompt_tokens - len(prompt)) // calls
    for call in range(calls):
        response = [rng.randrange(100, 50_000) for _ in range(rng.randrange(40, 160))]
        events.append(
            ModelRequestRecorded(
                run_id=run_id, rollout_id=rid, attempt_id=aid, call_id=f"c{call}", model="policy", weights_version=1,
                prompt_ids=list(prompt), response_ids=response, logprobs=[-rng.random() for _ in response],
                finish_reason="tool_calls",
                request={"model": "policy", "messages": [{"role": "user", "content": _text(rng, len(prompt) // 4)}]},
                response={"choices": [{"message": {"role": "assistant", "content": _text(rng, 30), "tool_calls": [
                    {"id": f"t{call}", "type": "function",
                     "function": {"name": "bash", "arguments": '{"cmd": "ls src && python -m pytest -q"}'}}]}}]},
                usage={"prompt_tokens": len(prompt), "completion_tokens": len(response)}, latency_s=rng.random(),
            )
        )  # fmt: skip
        if call % 4 == 3:
            events.append(
                CustomEvent(run_id=run_id, rollout_id=rid, attempt_id=aid, name="tool", payload={"out": _text(rng, 40)})
            )
        prompt = prompt + response + [rng.randrange(100, 50_000) for _ in range(step)]
    events.append(RewardReported(run_id=run_id, rollout_id=rid, attempt_id=aid, value=float(rng.random() > 0.5)))
    events.append(RolloutStatusChanged(run_id=run_id, rollout_id=rid, attempt_id=aid, status="succeeded",
                                       previous="running"))  # fmt: skip
    return events


def iter_stream(rollouts: int, run_id: str, seed: int = 7) -> Iterator[Event]:
    """The benchmark's events: a run and `rollouts` interleaved in groups of 16, as if running concurrently."""
    rng = random.Random(seed)
    yield RunStarted(run_id=run_id, name="bench")
    for base in range(0, rollouts, 16):
        streams = [rollout_events(rng, run_id, i) for i in range(base, min(rollouts, base + 16))]
        while any(streams):
            for s in streams:
                if s:
                    yield s.pop(0)


def make_stream(rollouts: int, run_id: str, seed: int = 7) -> list[Event]:
    """`iter_stream` as a list."""
    return list(iter_stream(rollouts, run_id, seed))


async def _rows(url: str) -> dict[str, tuple[list[str], list[tuple[Any, ...]]]]:
    conn = await asyncpg.connect(url)
    try:
        out = {}
        for table in TABLES:
            rows = await conn.fetch(f"SELECT * FROM {table}")
            out[table] = (list(rows[0].keys()) if rows else [], [tuple(r) for r in rows])
        return out
    finally:
        await conn.close()


async def raw_copy_seconds(admin_url: str, rows: dict[str, tuple[list[str], list[tuple[Any, ...]]]]) -> float:
    """Time a COPY of `rows` into empty read-model tables of a fresh database."""
    admin = await asyncpg.connect(admin_url)
    await admin.execute("DROP DATABASE IF EXISTS bench_raw")
    await admin.execute("CREATE DATABASE bench_raw")
    await admin.close()
    conn = await asyncpg.connect(admin_url.rsplit("/", 1)[0] + "/bench_raw")
    try:
        await migrate(conn)
        start = time.perf_counter()
        async with conn.transaction():
            for table, (columns, records) in rows.items():
                if records:
                    await conn.copy_records_to_table(table, records=records, columns=columns)
        return time.perf_counter() - start
    finally:
        await conn.close()


async def throughput(nats_url: str, pg_url: str, rollouts: int) -> None:
    events = make_stream(rollouts, "bench")
    store = await EventStore.connect(nats_url)
    for start in range(0, len(events), 2000):
        await store.append_many(events[start : start + 2000])
    await store.close()
    calls = sum(isinstance(e, ModelRequestRecorded) for e in events)
    print(f"stream: {len(events)} events ({calls} model calls, {rollouts} rollouts)")
    projector = Projector(ProjectorSettings(nats_url=nats_url, database_url=pg_url))
    tune_gc()  # as `python -m services.projector` does
    task = asyncio.create_task(projector.run())
    while projector.status.applied_seq == 0 and projector.status.batches_total == 0:
        await asyncio.sleep(0.001)
    began = time.perf_counter()
    while projector.status.applied_seq < len(events):
        await asyncio.sleep(0.002)
    projected_s = time.perf_counter() - began
    projector.stop.set()
    await task
    raw_s = await raw_copy_seconds(pg_url, await _rows(pg_url))
    projected, raw = len(events) / projected_s, len(events) / raw_s
    print(f"projector: {projected:,.0f} events/s ({projected_s:.2f} s; first batch excluded from timing)")
    print(f"raw COPY of the same rows: {raw:,.0f} events/s ({raw_s:.2f} s)")
    print(f"ratio: {projected / raw:.2f}x (target >= 0.5x)")


async def steady_lag(nats_url: str, pg_url: str, rate: int, seconds: float) -> None:
    """Publish at `rate` events/s for `seconds` while a projector process runs; report per-event lag."""
    total = int(rate * seconds)
    events = itertools.islice(iter_stream(total // 12 + 16, "steady"), total)
    store = await EventStore.connect(nats_url)
    conn = await asyncpg.connect(pg_url)
    start_seq = await store.last_sequence()
    committed: list[tuple[float, int]] = []
    await conn.add_listener(
        NOTIFY_CHANNEL, lambda *args: committed.append((time.time(), int(args[3].rsplit(":", 1)[1])))
    )
    port = free_port()
    projector = subprocess.Popen(
        [sys.executable, "-m", "services.projector", "--nats-url", nats_url, "--database-url", pg_url,
         "--metrics-port", str(port)],
        cwd=ROOT, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        async with httpx.AsyncClient() as client:  # wait until it runs and has caught up
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    health = (await client.get(f"http://127.0.0.1:{port}/healthz")).json()
                    if health["status"] == "ok" and health["applied_seq"] >= start_seq:
                        break
                await asyncio.sleep(0.1)
        published: list[tuple[int, float]] = []
        begin = time.perf_counter()
        sent = 0
        while sent < total:  # every 5 ms, pipeline the events that are due
            due = min(total, int((time.perf_counter() - begin) * rate) + 1)
            if due > sent:
                at = time.time()
                acks = await store.append_many(list(itertools.islice(events, due - sent)))
                published += [(ack.seq, at) for ack in acks]
                sent = due
            await asyncio.sleep(0.005)
        achieved = total / (time.perf_counter() - begin)
        while not committed or committed[-1][1] < published[-1][0]:
            await asyncio.sleep(0.01)
    finally:
        projector.send_signal(signal.SIGTERM)
        projector.wait(30)
    lags = []
    pointer = 0
    for seq, at in published:
        while committed[pointer][1] < seq:
            pointer += 1
        lags.append(committed[pointer][0] - at)
    lags.sort()

    def pct(p: float) -> float:
        return lags[min(len(lags) - 1, int(p * len(lags)))]

    print(f"steady load: {achieved:,.0f} events/s offered for {seconds:.0f} s from seq {start_seq + 1}")
    p50, p99, worst = pct(0.5) * 1000, pct(0.99) * 1000, lags[-1] * 1000
    print(f"lag p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {worst:.0f} ms (target p99 < 1 s)")
    await conn.close()
    await store.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=400)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--skip-lag", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollwire-bench-") as tmp:
        nats = NatsServer(Path(tmp) / "nats").start()
        pg = PostgresServer(Path(tmp) / "pg", durable=True).start()
        try:
            await throughput(nats.url, pg.url, args.rollouts)
            if not args.skip_lag:
                await steady_lag(nats.url, pg.url, args.rate, args.seconds)
        finally:
            with contextlib.suppress(Exception):
                pg.stop()
            nats.stop()


if __name__ == "__main__":
    run(main())  # on uvloop when installed, as `python -m services.projector` runs
