"""Kubernetes backend figures against the fake API server (tests/services/controller/k8s/fake_apiserver.py, real HTTP).

    python bench/bench_k8s.py [--jobs 1000] [--rate 50] [--samples 200] [--threads 8]

1. Creation: `launch` of N attempts at once, with the creation rate limit off (what the backend,
   the official client and the fake server sustain) and at `--rate` per second (burst 1), where
   the figure should be the configured rate.
2. Completion to report: the fake kubelet marks one running Job's pod succeeded (the job
   controller then marks the Job Complete); the delay until the backend's `watch()` yields
   `succeeded` for it, one at a time (p50/p95/max), then for `--samples` Jobs at once.

The fake server runs in this process (threads), so both sides share the CPUs; a real API server
is slower per request, but the backend's side of the work is the same.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "services" / "controller" / "k8s"))

from fake_apiserver import FakeApiServer  # noqa: E402

from services.controller.backends.base import ExecutionKey, ExecutionState, LaunchSpec  # noqa: E402
from services.controller.backends.k8s_template import job_name  # noqa: E402
from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings  # noqa: E402

TEMPLATE = (REPO / "infra" / "k8s" / "job-template.yaml").read_text()


def spec(key: ExecutionKey) -> LaunchSpec:
    env = {"OPENAI_BASE_URL": "http://gateway:8080/v1", "OPENAI_API_KEY": "token", "ROLLWIRE_EVENTS_URL": "http://g/e"}
    return LaunchSpec(key=key, env=env, input_json='{"question": "2+2"}', timeout_s=600)


def backend(server: FakeApiServer, threads: int, rate: float | None) -> KubernetesBackend:
    settings = KubernetesSettings(
        job_template=TEMPLATE,
        namespace="bench",
        image="registry.example/agent:1",
        create_rate=rate,
        create_burst=1,
        api_threads=threads,
        resync_s=300,
    )
    return KubernetesBackend(settings, api_client=server.api_client())


async def creation(jobs: int, threads: int, rate: float | None) -> float:
    """Jobs created per second when `jobs` launches are issued at once."""
    with FakeApiServer(validate=False, history_limit=10 * jobs) as server:
        b = backend(server, threads, rate)
        keys = [ExecutionKey("bench", f"r{i}", "a1") for i in range(jobs)]
        await b.launch(spec(ExecutionKey("bench", "warmup", "a1")))  # client and pool warm-up
        started = time.perf_counter()
        await asyncio.gather(*(b.launch(spec(k)) for k in keys))
        elapsed = time.perf_counter() - started
        assert len(server.jobs()) == jobs + 1
        await b.close()
        return jobs / elapsed


class Reports:
    """The watch's states, and an event per (key, phase) to wait on."""

    def __init__(self) -> None:
        self.seen: dict[tuple[ExecutionKey, str], float] = {}
        self.changed = asyncio.Event()

    async def follow(self, b: KubernetesBackend) -> None:
        state: ExecutionState
        async for state in b.watch():
            self.seen.setdefault((state.key, state.phase), time.perf_counter())
            self.changed.set()

    async def wait(self, keys: list[ExecutionKey], phase: str) -> float:
        while not all((k, phase) in self.seen for k in keys):
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 10)
        return max(self.seen[(k, phase)] for k in keys)


async def completion(samples: int, threads: int) -> tuple[list[float], float, float]:
    """Delays (s) from a pod's success to `succeeded` from the watch: one at a time, then all at once.

    The last figure is how long the fake kubelet itself took to mark the batch (part of the total).
    """
    with FakeApiServer(validate=False, history_limit=100 * samples) as server:
        b = backend(server, threads, None)
        reports = Reports()
        follower = asyncio.create_task(reports.follow(b))
        keys = [ExecutionKey("bench", f"r{i}", "a1") for i in range(2 * samples)]
        await asyncio.gather(*(b.launch(spec(k)) for k in keys))
        for k in keys:
            server.set_pod_running(job_name(k))
        await reports.wait(keys, "running")
        one_by_one = []
        for k in keys[:samples]:
            started = time.perf_counter()
            server.set_pod_succeeded(job_name(k))
            one_by_one.append(await reports.wait([k], "succeeded") - started)
        batch = keys[samples:]
        started = time.perf_counter()
        for k in batch:
            server.set_pod_succeeded(job_name(k))
        marked = time.perf_counter() - started
        all_at_once = await reports.wait(batch, "succeeded") - started
        follower.cancel()
        await b.close()
        return one_by_one, all_at_once, marked


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000, help="launches for the unlimited creation figure")
    parser.add_argument("--rate", type=float, default=50.0, help="creation rate limit to check (Jobs/s)")
    parser.add_argument("--samples", type=int, default=200, help="completions to time")
    parser.add_argument("--threads", type=int, default=8, help="the backend's API threads")
    args = parser.parse_args()

    unlimited = await creation(args.jobs, args.threads, None)
    print(f"creation, no rate limit:        {unlimited:8.0f} Jobs/s  ({args.jobs} launches at once)")
    limited_jobs = int(args.rate * 4)
    limited = await creation(limited_jobs, args.threads, args.rate)
    print(
        f"creation, limit {args.rate:g}/s burst 1:  {limited:8.1f} Jobs/s  "
        f"({limited_jobs} launches at once; {limited / args.rate:.3f}x the limit)"
    )
    delays, batch, marked = await completion(args.samples, args.threads)
    ms = [d * 1000 for d in delays]
    print(
        f"pod succeeded -> watch reports succeeded, one at a time: p50 {percentile(ms, 50):.1f} ms, "
        f"p95 {percentile(ms, 95):.1f} ms, max {max(ms):.1f} ms  ({len(ms)} Jobs)"
    )
    print(
        f"pod succeeded -> watch reports succeeded, {args.samples} at once: all reported in {batch * 1000:.0f} ms "
        f"(of which the fake kubelet marking them: {marked * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    asyncio.run(main())
