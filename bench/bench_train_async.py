"""Collocated async against sync training, on the quickstart harness with a long tail of slow agents.

    python bench/bench_train_async.py [--steps 8] [--slow-fraction 0.1] [--slow-s 8] [--fast-s 0.1]

Both runs use the same embedded stack, the warm-started quickstart model, 8 tasks x 4 rollouts per
step, and the same agent: the quickstart harness whose environment setup and tool calls each take
`--fast-s`, or `--slow-s` with probability `--slow-fraction` (`bench/slow_tool_agent.py`).

- sync: each step declares 8 groups and waits for all 32 rollouts, so nearly every step waits
  for a slow one;
- async (collocated): 16 groups in flight, an update as soon as 8 have ended; slow rollouts keep
  running across updates (their calls then carry two weights versions; calls more than one
  version behind are dropped).

Prints the wall time of each run for the same number of steps and the ratio (target >= 2x), and
the quickstart harness's samples per rollout and merge ratio (calls merged per sample).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from schemas import ModelRequestRecorded
from services.common.eventstore import EventStore
from trainer.clients import ServiceUrls
from trainer.embedded import embedded_stack
from trainer.loop import Trainer
from trainer.quickstart.run import QuickstartOptions, fork_server, quickstart_config
from trainer.quickstart.task import make_tasks, write_tasks_jsonl
from trainer.quickstart.warmstart import ensure_warm_model

BENCH_DIR = Path(__file__).resolve().parent


async def versions_per_rollout(urls: ServiceUrls, run_id: str) -> dict[str, set[int | None]]:
    """The weights versions each rollout's calls ran on, read back from the stream."""
    store = await EventStore.connect(urls.nats_url)
    try:
        found: dict[str, set[int | None]] = {}
        async for stored in store.read_run(run_id):
            if isinstance(stored.event, ModelRequestRecorded) and stored.event.rollout_id:
                found.setdefault(stored.event.rollout_id, set()).add(stored.event.weights_version)
        return found
    finally:
        await store.close()


def run(options: QuickstartOptions, name: str, model: Path, dataset: Path, command: list[str], urls: ServiceUrls,
        extra: dict[str, Any]) -> tuple[float, list[dict[str, Any]]]:  # fmt: skip
    """Train one run; returns its wall time and metric rows."""
    options.extra = extra
    config = quickstart_config(options, name, model, dataset, command)
    start = time.monotonic()
    rows = asyncio.run(Trainer(config, urls, say=lambda line: None).run())
    return time.monotonic() - start, rows


def mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--slow-fraction", type=float, default=0.1)
    parser.add_argument("--slow-s", type=float, default=8.0)
    parser.add_argument("--fast-s", type=float, default=0.1)
    parser.add_argument("--min-groups", type=int, default=8)
    parser.add_argument("--groups-in-flight", type=int, default=16)
    args = parser.parse_args()

    model = ensure_warm_model()
    env = {
        "AGENT_SEED": "0",
        "BENCH_SLOW_FRACTION": str(args.slow_fraction),
        "BENCH_SLOW_S": str(args.slow_s),
        "BENCH_FAST_S": str(args.fast_s),
    }
    stamp = time.strftime("%H%M%S")
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rw-bench-train-")))
        dataset = tmp / "tasks.jsonl"
        dataset.write_bytes(write_tasks_jsonl(make_tasks(512, seed=0)))
        command = stack.enter_context(fork_server("slow_tool_agent", [BENCH_DIR]))
        urls = stack.enter_context(embedded_stack(tmp / "stack", model, say=lambda line: None))
        options = QuickstartOptions(steps=args.steps, out=tmp / "runs", data_dir=tmp / "stack")
        agent = {"env": env, "concurrency": 4 * args.groups_in_flight}
        sync_s, sync_rows = run(options, f"bench-sync-{stamp}", model, dataset, command, urls, {"agent": agent})
        options.mode = "async"
        asynchronous = {"min_groups": args.min_groups, "max_groups_in_flight": args.groups_in_flight}
        async_s, async_rows = run(
            options, f"bench-async-{stamp}", model, dataset, command, urls, {"agent": agent, "async": asynchronous}
        )
        crossed = asyncio.run(versions_per_rollout(urls, f"bench-async-{stamp}"))

    print(f"slow tail: each wait {args.fast_s}s, or {args.slow_s}s with p={args.slow_fraction}; "
          f"{args.steps} steps of 8 tasks x 4 rollouts; {sys.platform}")  # fmt: skip
    print(f"{'mode':<6} {'wall s':>7} {'s/step':>7} {'rollouts':>9} {'reward':>7} {'samples/rollout':>16} "
          f"{'calls/sample':>13} {'stale calls':>12}")  # fmt: skip
    for mode, seconds, rows in (("sync", sync_s, sync_rows), ("async", async_s, async_rows)):
        print(
            f"{mode:<6} {seconds:>7.1f} {seconds / len(rows):>7.2f} {sum(r['rollouts'] for r in rows):>9} "
            f"{mean(rows, 'reward_mean'):>7.2f} {mean(rows, 'samples_per_rollout'):>16.2f} "
            f"{mean(rows, 'merge_ratio'):>13.2f} {sum(r['calls_stale_dropped'] for r in rows):>12}"
        )
    two_versions = sum(1 for v in crossed.values() if len({x for x in v if x is not None}) > 1)
    print(f"async speedup: {sync_s / async_s:.2f}x (target >= 2x); rollouts whose calls ran on two weights "
          f"versions: {two_versions} of {len(crossed)}")  # fmt: skip


if __name__ == "__main__":
    main()
