"""Replay throughput and memory: `replay_run` against a raw read of the same run's events.

    python bench/bench_replay.py                      # 10,000 rollouts x 10 calls (100k calls)
    python bench/bench_replay.py --rollouts 1000      # a quick look
    python bench/bench_replay.py --repeat 1           # one round (default: 3 rounds)

The run is written to a fresh nats-server the way a live run writes it: groups of 8 rollouts of
one task, 256 rollouts in flight at once (their events interleaved on the stream), each a linear
conversation of `--calls` calls whose context grows to about `--context` tokens, with the
conversation's text in each call's request (as harnesses send it). Then, each in a fresh process:

- raw read: `EventStore.read_raw` of `rl.<run>.>` (every message's bytes, no decoding);
- typed read: `EventStore.read_run` (every event decoded; the floor of a naive replay);
- typed read, as recorded: `read_run(unpack=False)` (calls keep their packed arrays);
- replay: `replay_run` (index pass + calls read group by group + the trainer's adapter);
- replay of three schemes side by side (`--compare`);
- for the small run only, the naive way: read the whole run, `collect_rollouts`, `build_step`.

The replay runs in this process, and with worker processes (one per core, at most 8, each
reading and replaying its share of the run). Every mode is measured once a round, `--repeat`
rounds (3 by default), each measurement in a fresh process. A row gives the mode's fastest wall
time (and its slowest), its ratio to the raw read's fastest, and the median and range of its
ratio to the raw read of the same round: a shared machine's speed drifts from minute to minute,
and a round keeps a mode and its baseline close together. It also gives the CPU time the whole
machine spent during the fastest measurement (this process, its workers and nats-server) and how
much the memory of this process and its descendants grew (sampled every 20 ms). A second run of a
tenth of the size shows that the replay's memory does not grow with the run (targets: >= 0.7x the
raw read's speed, memory bounded by a group, not the run).

Measured on a machine with 2 vCPUs that gave two cores' work (one Python loop 1.21 s alone,
1.24 s and 1.27 s with a second beside it), 100k calls, compact recording (each call
referencing the one before it, 554 MB on the stream), 5 rounds: fastest wall s (slowest), x the
raw read's fastest, median x of the rounds (range):

    raw read                 2.67 s (2.79)  1.00x
    typed read, lists        4.29 s (4.48)  0.62x   rounds 0.62x (0.62-0.62)
    typed read, as recorded  3.48 s (3.61)  0.77x   rounds 0.77x (0.74-0.80)
    replay, in-process       4.83 s (5.06)  0.55x   rounds 0.55x (0.53-0.58)
    replay, 2 workers        3.44 s (3.90)  0.78x   rounds 0.75x (0.70-0.81)
    replay, 3 schemes        3.91 s (4.13)  0.68x   rounds 0.68x (0.65-0.70)

A second run of 5 rounds: as recorded 0.74x (0.73-0.76), replay with 2 workers 0.76x, rounds
0.76x (0.72-0.78). On the same machine, the replay with 2 workers gave 0.72x, rounds 0.71x
(0.64-0.76) before two cuts in its per-call work, and 0.74x, rounds 0.73x (0.69-0.76) after the
first (a rollout's small events and calls merged by a sort) but before the second (a call's
full prompt a slice of its attempt's ids array, `schemas.refs.unpack_together`). Machines
differ: on a shared machine whose two vCPUs did not give two cores' work (its raw read 3.57 s
to 6.10 s), an earlier tree gave 0.62x (0.57-0.93) for the replay with 2 workers and 0.66x
(0.58-0.92) for the typed read as recorded.

Where the replay's time goes (2 workers, 100k calls): the index 0.6-0.8 s (this process alone,
30k small messages), then each worker about 2.0 s of CPU (reading its half of the calls about
0.9 s, decoding and merging them 0.9 s); the server spends 1.55-1.63 s over the whole replay
(about 0.2 s of it on the index): the two cores are busy.

A typed read with lists makes a Python int or float per token (`upcast`): that alone costs about
as much per call as decoding the rest. As recorded, a call keeps its packed arrays, and what is
left is msgspec parsing each call's JSON (the request's text, the base64 of the arrays, about
1 us for 2 KB) and the envelope's checks. The replay makes no object per token; what is left of
it is the NATS client's parsing of every message (a raw read's whole cost, paid again by the
replay's reads, about a third of a worker's CPU) and decoding and merging each call, on two cores
shared with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from schemas import (
    AttemptStarted,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
)
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.tools.replay import default_workers

GROUP = 8
IN_FLIGHT = 256
VOCAB = 150_000
WORDS = ("the", "test", "fails", "because", "import", "module", "def", "return", "value", "error", "file")


def _rollout(run_id: str, index: int, calls: int, context: int, rng: random.Random) -> list[Event]:
    rid, group = f"ro{index}", f"task{index // GROUP}"
    turn = max(8, (context - 256) // (2 * calls))
    events: list[Event] = [
        RolloutCreated(run_id=run_id, rollout_id=rid, group_id=group, input={"task": group}),
        AttemptStarted(run_id=run_id, rollout_id=rid, attempt_id="a1", sequence=1),
        RolloutStatusChanged(run_id=run_id, rollout_id=rid, attempt_id="a1", status="running", previous="queuing"),
    ]
    sequence = rng.choices(range(VOCAB), k=256)
    for n in range(calls):
        response = rng.choices(range(VOCAB), k=rng.randint(turn // 2, turn * 3 // 2))
        text = " ".join(rng.choices(WORDS, k=len(sequence) // 2))
        events.append(
            ModelRequestRecorded(
                run_id=run_id, rollout_id=rid, attempt_id="a1", call_id=f"{rid}-{n}", model="policy",
                weights_version=1, prompt_ids=sequence, response_ids=response,
                logprobs=[round(-rng.random(), 4) for _ in response], finish_reason="stop",
                request={"model": "policy", "messages": [{"role": "user", "content": text}]},
                response={"message": {"role": "assistant", "content": "```bash\npytest -q\n```"}},
                usage={"prompt_tokens": len(sequence), "completion_tokens": len(response)}, latency_s=0.4,
            )
        )  # fmt: skip
        observation = rng.choices(range(VOCAB), k=rng.randint(turn // 2, turn * 3 // 2))
        sequence = sequence + response + observation
    events.append(RewardReported(run_id=run_id, rollout_id=rid, attempt_id="a1", value=float(rng.random() < 0.4)))
    events.append(RolloutStatusChanged(run_id=run_id, rollout_id=rid, attempt_id="a1", status="succeeded"))
    return events


def live_order(run_id: str, rollouts: int, calls: int, context: int, seed: int = 0) -> Iterator[Event]:
    """The run's events as a live run appends them: `IN_FLIGHT` rollouts interleaved, lazily."""
    rng = random.Random(seed)
    waiting = iter(range(rollouts))
    running: list[Iterator[Event]] = []
    while True:
        while len(running) < IN_FLIGHT:
            index = next(waiting, None)
            if index is None:
                break
            running.append(iter(_rollout(run_id, index, calls, context, rng)))
        if not running:
            return
        pick = rng.randrange(len(running))
        event = next(running[pick], None)
        if event is None:
            running.pop(pick)
        else:
            yield event


async def write_run(
    url: str, run_id: str, rollouts: int, calls: int, context: int, fmt: str = "full"
) -> tuple[int, float]:
    """Append the run; `compact` records calls as the gateway does (references to the previous call, packed)."""
    # Imported here, not at the top: the replay's workers preload the main script's imports, and
    # `rollwire replay` (the main script users run) does not import the gateway and its web stack.
    from services.gateway.proxy.recording import CallChains

    store = await EventStore.connect(url)
    chains = CallChains(compact=fmt == "compact")
    size = 2000
    batch: list[Event] = []
    originals: list[Event] = []
    # Rollouts with a call in the batch: the gateway answers a call only once its event is
    # acknowledged, so a rollout's next call (compacted here) always finds the one before it acknowledged.
    calling: set[str | None] = set()
    n = 0
    started = time.perf_counter()

    async def flush() -> None:
        acks = await store.append_many(batch)
        for event, ack in zip(originals, acks, strict=True):
            if isinstance(event, ModelRequestRecorded):
                chains.remember([event], [ack])
        batch.clear()
        originals.clear()
        calling.clear()

    for event in live_order(run_id, rollouts, calls, context):
        if isinstance(event, ModelRequestRecorded):
            if event.rollout_id in calling:
                n += len(batch)
                await flush()
            calling.add(event.rollout_id)
            batch.append(chains.compact([event])[0])
        else:
            batch.append(event)
        originals.append(event)
        if len(batch) == size:
            n += len(batch)
            await flush()
    n += len(batch)
    await flush()
    await store.close()
    return n, time.perf_counter() - started


def _machine_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy (every core, every process: this one, its workers, nats-server)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _tree_rss_mb(root: int) -> float:
    """Resident memory of a process and all its descendants (the replay's workers and their server)."""
    pages, frontier = 0, [root]
    while frontier:
        pid = frontier.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                pages += int(f.read().split()[1])
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    frontier.extend(int(child) for child in f.read().split())
        except OSError:  # the process ended meanwhile
            continue
    return pages * resource.getpagesize() / 1e6


class PeakRss:
    """Samples the RSS of a process and its descendants every 20 ms, from a thread of this process.

    The measured process is another one (`measure` samples its child), so the sampling costs the
    measurement nothing: walking /proc from a thread of the measured process would take its GIL.
    """

    def __init__(self, root: int) -> None:
        self.root = root
        self.start = _tree_rss_mb(root)
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _tree_rss_mb(self.root))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


async def child(mode: str, url: str, run_id: str, workers: int | None) -> dict[str, float]:
    """One measurement, in its own process so its memory is its own."""
    from services.tools.replay import replay_run
    from trainer.core import AdapterConfig, build_step, collect_rollouts

    store = await EventStore.connect(url, ensure=False)
    print("started", flush=True)  # the parent samples memory from here on
    started, cpu = time.perf_counter(), _machine_cpu_seconds()
    result: dict[str, float] = {}
    if mode == "raw":
        count = size = 0
        async for batch in store.read_raw(f"rl.{run_id}.>"):
            count += len(batch)
            size += sum(len(m.data) for m in batch)
        result.update(events=count, mb=size / 1e6)
    elif mode in ("typed", "packed"):
        count = 0
        stream = store.read_run(run_id, unpack=False) if mode == "packed" else store.read_run(run_id)
        async for _ in stream:  # decoded and dropped, as the raw read drops its bytes
            count += 1
        result["events"] = count
    elif mode == "replay":
        report = await replay_run(store, run_id, workers=workers)
        result.update(samples=report.schemes[0].summary.samples, calls=report.schemes[0].summary.calls)
    elif mode == "compare":
        specs = ["rollout-mean", "seq-mean-token-mean", "token-mean"]
        report = await replay_run(store, run_id, compare_specs=specs, workers=workers)
        result.update(samples=report.schemes[0].summary.samples)
    elif mode == "naive":
        events = [s.event async for s in store.read_run(run_id)]
        step = build_step(collect_rollouts(events).rollouts, AdapterConfig())
        result.update(samples=step.stats.samples)
    result["seconds"] = time.perf_counter() - started
    result["cpu_seconds"] = _machine_cpu_seconds() - cpu
    await store.close()
    return result


def measure(mode: str, url: str, run_id: str, workers: int | None = None) -> dict[str, float]:
    """One measurement in a child process; its memory (with its workers') is sampled from here."""
    extra = [] if workers is None else ["--workers", str(workers)]
    with subprocess.Popen(
        [sys.executable, __file__, "--child", mode, "--url", url, "--run", run_id, *extra],
        stdout=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        proc.stdout.readline()  # "started": connected, imports done
        rss = PeakRss(proc.pid)
        out = proc.stdout.read()
        growth = rss.stop()
    if proc.returncode:
        raise SystemExit(f"the {mode} measurement failed (exit {proc.returncode})")
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    result["rss_growth_mb"] = growth
    return result


Mode = tuple[str, str, int | None]
"""A row of the table: its label, the child's mode and the replay's worker processes."""


def rounds(repeat: int, modes: list[Mode], url: str, run_id: str) -> dict[str, list[dict[str, float]]]:
    """`repeat` rounds, each measuring every mode once in turn: each label's measurements, by round.

    A mode and the raw read it is compared with are then measured close together (see the module
    docstring for why).
    """
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in modes}
    for n in range(repeat):
        for label, mode, workers in modes:
            print(f"  round {n + 1}/{repeat}: {label}", end="\r", file=sys.stderr, flush=True)
            results[label].append(measure(mode, url, run_id, workers))
    print(" " * 60, end="\r", file=sys.stderr)
    return results


def report_row(label: str, runs: list[dict[str, float]], raw: list[dict[str, float]]) -> str:
    """A mode's fastest and slowest time; its ratio to the raw read, of the bests and per round (median, range)."""
    best = min(runs, key=lambda r: r["seconds"])
    slowest = max(r["seconds"] for r in runs)
    ratios = sorted(r0["seconds"] / r["seconds"] for r0, r in zip(raw, runs, strict=True))
    return (
        f"  {label:24s} {best['seconds']:6.2f} s (to {slowest:5.2f}) "
        f"{min(r['seconds'] for r in raw) / best['seconds']:5.2f}x raw  "
        f"rounds {statistics.median(ratios):4.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})  "
        f"machine cpu {best['cpu_seconds']:6.2f} s  memory +{best['rss_growth_mb']:5.0f} MB"
    )


def idle_rss() -> float:
    code = "import resource, services.tools.replay, services.common.eventstore; "
    code += "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    return float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--context", type=int, default=2048, help="tokens of a rollout's last call")
    parser.add_argument("--workers", type=int, default=None, help="replay worker processes (default: auto)")
    parser.add_argument("--format", choices=["full", "compact"], default="compact", help="how calls are recorded")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of measurements (each mode once a round)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.child, args.url, args.run, args.workers))))
        return
    small = max(GROUP, args.rollouts // 10)
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp)).start()
        try:
            for run_id, rollouts in (("big", args.rollouts), ("small", small)):
                n, secs = asyncio.run(write_run(server.url, run_id, rollouts, args.calls, args.context, args.format))
                print(f"wrote run {run_id} ({args.format}): {rollouts} rollouts, {rollouts * args.calls} calls, "
                      f"{n} events in {secs:.0f}s")  # fmt: skip
            workers = default_workers() if args.workers is None else args.workers
            print(f"{os.cpu_count()} CPU cores; replay workers: {workers}")
            print(f"{args.repeat} rounds: each mode's fastest, then the median and range of its rounds' ratios")
            for run_id in ("big", "small"):
                modes: list[Mode] = [
                    ("raw read (bytes)", "raw", None),
                    ("typed read (decode all)", "typed", None),
                    ("typed read, as recorded", "packed", None),
                    ("replay, in-process", "replay", 0),
                ]
                if workers:
                    modes.append((f"replay, {workers} workers", "replay", workers))
                modes.append(("replay, 3 schemes", "compare", args.workers))
                if run_id == "small":
                    modes.append(("load all + build_step", "naive", None))
                measured = rounds(args.repeat, modes, server.url, run_id)
                raw = measured["raw read (bytes)"]
                print(f"\nrun {run_id}: {raw[0]['events']:.0f} events, {raw[0]['mb']:.0f} MB on the stream")
                for label, runs in measured.items():
                    print(report_row(label, runs, raw))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
