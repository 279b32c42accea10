"""Re-training from the log: time per step against the live run's, and memory bounded by one step.

    python bench/bench_retrain.py                          # both parts (records a short quickstart run first)
    python bench/bench_retrain.py --part memory            # the reader on a synthetic 100k-call run
    python bench/bench_retrain.py --part time --run R --run-dir runs/R --nats-dir .rollwire/nats

**time**: a recorded quickstart-like run (`--steps` steps of 4 tasks x 4 rollouts on the
embedded stack, or the run given) is re-trained under its own scheme and under each `--schemes`
one, from step 0. Per step it reports the re-train's time (reading the step from the stream,
the proximal forward pass, the update, saving) against the live run's training time
(`time_replay_s` + `time_update_s` + `time_save_s` in its metrics.csv), and, measured here in the
same process right after the re-train so both see the same machine, the live path alone: the
trainer's `backend.update` on the same samples from the same weights. It ends with each scheme's
final loss and mean reward of its last step.

**memory**: a synthetic run written to a fresh nats-server the way `bench_replay` writes one
(groups of 8 rollouts, 256 in flight, `--calls` calls each), with a `train_step` record on every
rollout (`--groups-per-step` groups a step), read step by step by `StepReader` with each step
built by the adapter: the growth of this process's memory (sampled every 20 ms; the nats-server
it starts is left out: it caches the stream) and the most calls held, for the whole run and for
a run a tenth its size. Bounded by a step, both grow alike.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_replay import GROUP, write_run

from schemas import CustomEvent
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from services.tools.retrain import (
    RetrainOptions,
    RunFiles,
    build_retrain_backend,
    retrain_run,
    scheme_batch,
    schemes_for,
)
from services.tools.retrain_source import StepReader
from services.tools.source import index_run
from trainer.core import TRAIN_STEP_EVENT, AdapterConfig, build_step


def rss_mb() -> float:
    """This process's resident memory alone (not its children: the nats-server it started caches the stream)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


class Sampler:
    """This process's RSS, sampled every 20 ms from a thread: the peak growth over the start."""

    def __init__(self) -> None:
        self.start = rss_mb()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_mb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


async def write_steps(url: str, run_id: str, rollouts: int, groups_per_step: int) -> int:
    """A `train_step` record on every rollout of a `bench_replay` run: `groups_per_step` groups a step."""
    store = await EventStore.connect(url)
    per_step = GROUP * groups_per_step
    events = [
        CustomEvent(run_id=run_id, rollout_id=f"ro{i}", name=TRAIN_STEP_EVENT, payload={"step": i // per_step + 1})
        for i in range(rollouts)
    ]
    for start in range(0, len(events), 2000):
        await store.append_many(events[start : start + 2000])
    await store.close()
    return (rollouts + per_step - 1) // per_step


async def read_all(url: str, run_id: str) -> dict[str, float]:
    """Every step of the run read and built, one at a time: seconds, memory growth, calls held."""
    store = await EventStore.connect(url)
    try:
        index = await index_run(store, run_id)
        reader = StepReader(store, index)
        sampler = Sampler()
        started = time.perf_counter()
        samples = 0
        async for _, rollouts in reader.read(reader.steps()):
            samples += len(build_step(rollouts, AdapterConfig()).samples)
        seconds = time.perf_counter() - started
        grown = sampler.stop()
        calls = sum(e.calls for e in index.rollouts.values())
        return {"steps": reader.steps_read, "calls": calls, "seconds": seconds, "mb": grown,
                "peak_calls": reader.peak_calls, "samples": samples}  # fmt: skip
    finally:
        await store.close()


def memory_part(args: argparse.Namespace) -> None:
    """The reader on a run of `--rollouts` x `--calls` calls and on one a tenth its size."""
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp)).start()
        try:
            for run_id, rollouts in (("big", args.rollouts), ("small", max(GROUP, args.rollouts // 10))):
                asyncio.run(write_run(server.url, run_id, rollouts, args.calls, args.context, "compact"))
                steps = asyncio.run(write_steps(server.url, run_id, rollouts, args.groups_per_step))
                found = asyncio.run(read_all(server.url, run_id))
                print(f"run {run_id}: {found['calls']:.0f} calls in {steps} steps: read + built in "
                      f"{found['seconds']:.1f}s ({1000 * found['seconds'] / steps:.0f} ms a step); memory grew "
                      f"{found['mb']:.0f} MB; at most {found['peak_calls']:.0f} calls held")  # fmt: skip
        finally:
            server.stop()


def record_run(args: argparse.Namespace, tmp: Path) -> tuple[str, Path, Path]:
    """A short quickstart-like run on the embedded stack (the quickstart's own pieces)."""
    from trainer.quickstart.run import QuickstartOptions, run_quickstart

    options = QuickstartOptions(
        heldout_tasks=0,  # no held-out pass: this is about the steps
        steps=args.steps, data_dir=tmp / "stack", out=tmp / "runs", tasks_per_step=4, rollouts_per_task=4,
        run_name="bench", cache_dir=args.cache_dir,
        extra={"agent": {"env": {"AGENT_SEED": "0"}}, "run": {"keep_weights": 0}},
    )  # fmt: skip
    result = run_quickstart(options, say=lambda line: None)
    return "bench", result.run_dir, tmp / "stack" / "nats"


async def live_path(url: str, run_id: str, run_dir: Path) -> list[float]:
    """The trainer's update alone on each recorded step's samples, from the run's first weights (seconds)."""
    store = await EventStore.connect(url)
    files = RunFiles(run_id, run_dir)
    index = await index_run(store, run_id)
    (scheme,) = schemes_for([], files, index.recorded_adapter)  # the run's own
    backend = build_retrain_backend(files, scheme, index.steps[0], None)
    reader = StepReader(store, index, scheme.adapter.selection())
    seconds = []
    async for _, rollouts in reader.read(reader.steps()):
        batch = scheme_batch(rollouts, scheme, files.config.model.served_name)
        started = time.perf_counter()
        backend.update(batch.samples)
        seconds.append(time.perf_counter() - started)
    await store.close()
    return seconds


def _live_train_s(row: dict[str, Any]) -> float:
    return sum(float(row.get(f"time_{part}_s") or 0.0) for part in ("replay", "update", "save"))


def time_part(args: argparse.Namespace) -> None:
    """Re-train the recorded run under its own scheme and `--schemes`; compare time per step with the live run."""
    with tempfile.TemporaryDirectory() as tmp:
        if args.run:
            run_id, run_dir, nats_dir = args.run, Path(args.run_dir), Path(args.nats_dir)
        else:
            started = time.perf_counter()
            run_id, run_dir, nats_dir = record_run(args, Path(tmp))
            print(f"recorded run {run_id}: {args.steps} steps in {time.perf_counter() - started:.0f}s")
        server = NatsServer(nats_dir).start()
        try:

            async def retrain() -> list[Any]:
                store = await EventStore.connect(server.url)
                options = RetrainOptions(run_dir=run_dir, out=Path(tmp) / "retrain")
                try:
                    return await retrain_run(store, run_id, args.schemes, options)
                finally:
                    await store.close()

            own = asyncio.run(_own(server.url, run_id, run_dir, Path(tmp)))
            live_alone = asyncio.run(live_path(server.url, run_id, run_dir))
            others = asyncio.run(retrain()) if args.schemes else []
        finally:
            server.stop()
        live = RunFiles(run_id, run_dir).rows
        print("step  live: train s (update s)  re-train: step s (read, proximal, update)  live path here: update s")
        for row, mine, alone in zip(live, own.rows, live_alone, strict=False):
            print(f"{row['step']:>4}  {_live_train_s(row):>10.2f} ({float(row['time_update_s']):.2f})"
                  f"  {mine['time_step_s']:>15.2f} ({mine['time_read_s']:.2f}, {mine['time_proximal_s']:.2f}, "
                  f"{mine['time_update_s']:.2f})  {alone:>10.2f}")  # fmt: skip
        median = statistics.median
        print(f"median: live train {median(_live_train_s(r) for r in live):.2f}s, re-train step "
              f"{median(r['time_step_s'] for r in own.rows):.2f}s, "
              f"live path here {median(live_alone):.2f}s")  # fmt: skip
        for result in [own, *others]:
            last = result.rows[-1]
            print(
                f"{result.scheme:>24}: final loss {last['loss']:+.4f}, "
                f"reward of its last step {last['reward_mean']:.3f}"
            )


async def _own(url: str, run_id: str, run_dir: Path, tmp: Path) -> Any:
    store = await EventStore.connect(url)
    try:
        (own,) = await retrain_run(store, run_id, [], RetrainOptions(run_dir=run_dir, out=tmp / "own"))
        return own
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--part", choices=["time", "memory", "both"], default="both")
    parser.add_argument("--rollouts", type=int, default=10_000, help="memory: rollouts of the synthetic run")
    parser.add_argument("--calls", type=int, default=10, help="memory: calls per rollout")
    parser.add_argument("--context", type=int, default=2048, help="memory: tokens of a rollout's last call")
    parser.add_argument("--groups-per-step", type=int, default=8, help="memory: groups of 8 rollouts a step")
    parser.add_argument("--steps", type=int, default=4, help="time: steps of the recorded run")
    parser.add_argument("--schemes", nargs="*", default=["grpo", "rloo", "norm=token-mean", "norm=rollout-mean"])
    parser.add_argument("--cache-dir", type=Path, default=None, help="time: the quickstart's model cache")
    parser.add_argument("--run", help="time: a recorded run instead of a new one")
    parser.add_argument("--run-dir", help="time: its run directory")
    parser.add_argument("--nats-dir", help="time: its stream's storage (the stack's data dir/nats)")
    args = parser.parse_args()
    if args.part in ("time", "both"):
        time_part(args)
    if args.part in ("memory", "both"):
        memory_part(args)


if __name__ == "__main__":
    main()
