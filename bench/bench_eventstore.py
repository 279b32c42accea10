"""Event store throughput against raw nats-py on the same server, in the same run.

    python bench/bench_eventstore.py [--events 20000] [--replay 100000]

1. Append: model-request events with 2,000-token prompts and 200-token responses, pipelined with
   acks (`EventStore.append_many`), against raw `js.publish_async` of the same bytes.
2. Replay: one run of N events read back typed (`EventStore.read_run`) against a raw JetStream
   pull of the same messages with nats-py's `fetch` (bytes, no decoding), and against the event
   store's own raw transport (`read_raw`), which isolates the cost of decoding.
Prints events/s, MB/s and the ratios (targets: ≥ 0.7× raw for both).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from nats.js.api import AckPolicy, ConsumerConfig

from schemas import ModelRequestRecorded, encode, new_id
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer


def make_events(run_id: str, count: int, rollouts: int = 100) -> list[ModelRequestRecorded]:
    rng = random.Random(0)
    prompt = [rng.randrange(150_000) for _ in range(2000)]
    response = [rng.randrange(150_000) for _ in range(200)]
    logprobs = [-rng.random() * 3 for _ in range(200)]
    return [
        ModelRequestRecorded(
            run_id=run_id, rollout_id=f"ro{i % rollouts}", attempt_id="a1", call_id=f"c{i}",
            prompt_ids=prompt, response_ids=response, logprobs=logprobs, model="policy", weights_version=1,
            finish_reason="stop", usage={"prompt_tokens": 2000, "completion_tokens": 200}, latency_s=0.5,
        )
        for i in range(count)
    ]  # fmt: skip


async def bench_append(store: EventStore, count: int) -> tuple[float, float, float]:
    run_store, run_raw = new_id("ba"), new_id("br")
    ours = make_events(run_store, count)
    raw = [(e.subject.replace(run_store, run_raw), encode(e)) for e in make_events(run_raw, count)]
    size_mb = sum(len(p) for _, p in raw) / 1e6

    start = time.perf_counter()
    futures = []
    for subject, payload in raw:
        futures.append(await store.js.publish_async(subject, payload, headers={"Nats-Msg-Id": new_id()}))
    for f in futures:
        await f
    raw_s = time.perf_counter() - start

    start = time.perf_counter()
    for i in range(0, count, 1000):
        await store.append_many(ours[i : i + 1000])
    ours_s = time.perf_counter() - start
    return raw_s, ours_s, size_mb


async def bench_replay(store: EventStore, count: int) -> tuple[float, float, float, float, int]:
    run_id = new_id("rp")
    events = make_events(run_id, count, rollouts=1000)
    for i in range(0, count, 2000):
        await store.append_many(events[i : i + 2000])
    subject = f"rl.{run_id}.>"

    start = time.perf_counter()
    fetched = 0
    psub = await store.js.pull_subscribe(
        subject, stream=store.stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True)
    )
    while fetched < count:
        fetched += len(await psub.fetch(min(2048, count - fetched), timeout=10))
    await psub.unsubscribe()
    fetch_s = time.perf_counter() - start

    start = time.perf_counter()
    raw_n, raw_bytes = 0, 0
    async for batch in store.read_raw(subject):
        raw_n += len(batch)
        raw_bytes += sum(len(m.data) for m in batch)
    raw_s = time.perf_counter() - start

    start = time.perf_counter()
    ours_n = 0
    async for _ in store.read_run(run_id):
        ours_n += 1
    ours_s = time.perf_counter() - start
    assert raw_n == ours_n == fetched == count, (raw_n, ours_n, fetched, count)
    return fetch_s, raw_s, ours_s, raw_bytes / 1e6, count


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--replay", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp)).start()
        try:
            store = await EventStore.connect(server.url)
            raw_s, ours_s, mb = await bench_append(store, args.events)
            n = args.events
            print(f"append  {n} events x {mb / n * 1e3:.1f} KB (2000-token prompt, 200-token response)")
            print(f"  raw publish_async : {n / raw_s:9.0f} events/s {mb / raw_s:7.1f} MB/s")
            print(f"  EventStore.append : {n / ours_s:9.0f} events/s {mb / ours_s:7.1f} MB/s")
            print(f"  ratio             : {raw_s / ours_s:.2f}x raw (target >= 0.7)")
            fetch_s, raw_s, ours_s, mb, n = await bench_replay(store, args.replay)
            print(f"replay  one run of {n} events ({mb:.0f} MB)")
            print(f"  raw nats-py fetch : {n / fetch_s:9.0f} events/s {mb / fetch_s:7.1f} MB/s (bytes, no decoding)")
            print(f"  EventStore raw    : {n / raw_s:9.0f} events/s {mb / raw_s:7.1f} MB/s (read_raw: bytes)")
            print(f"  EventStore.read   : {n / ours_s:9.0f} events/s {mb / ours_s:7.1f} MB/s (typed, decoded)")
            print(f"  ratio             : {fetch_s / ours_s:.2f}x raw nats-py fetch (target >= 0.7)")
            print(f"  decode cost       : {(ours_s - raw_s) / n * 1e6:.0f} us/event over our own raw transport")
            await store.close()
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
