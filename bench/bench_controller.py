"""Controller throughput and latency on the local backend: executions started per second, queued → running.

Starts an embedded nats-server, a gateway and a controller as processes (as `rollwire up` does),
declares a run of trivial agents (`examples/agents/noop_agent.py`: read the input, exit 0) with
the given concurrency, creates all rollouts in one batch, and waits until every one succeeded.
Timings come from the status events themselves (the gateway's clock), so they are what any
subscriber would see:

- started/s: executions started per second while the run is saturated (`running` events over the
  span from the first to the last `running`);
- queued → running: per rollout, from its `queuing` event to its `running` event (includes the
  wait for a free slot: with 200 rollouts and 32 slots most of it is queueing);
- preparing → running: the controller's own launch latency (attempt started → process running);
- an idle run first: one rollout at a time, to show the latency without any queueing.

    .venv/bin/python bench/bench_controller.py                        # 200 agents, concurrency 32
    .venv/bin/python bench/bench_controller.py --rollouts 500 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from schemas import RolloutStatusChanged
from schemas.ids import ROLLOUT_STATUS
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer, free_port

REPO = Path(__file__).resolve().parents[1]
NOOP = REPO / "examples" / "agents" / "noop_agent.py"
ADMIN = "bench-admin-token"


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A service as a child process, its output in `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def wait_http(url: str, timeout: float = 60.0) -> None:
    """Until `url` answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


async def status_times(store: EventStore, run_id: str) -> dict[str, dict[str, float]]:
    """For each rollout of the run, the time of its first event of each status."""
    times: dict[str, dict[str, float]] = {}
    async for stored in store.read(ROLLOUT_STATUS.format(run=run_id, rollout="*")):
        event = stored.event
        assert isinstance(event, RolloutStatusChanged) and event.rollout_id is not None
        times.setdefault(event.rollout_id, {}).setdefault(event.status, event.time)
    return times


async def run_batch(
    store: EventStore, admin: httpx.AsyncClient, run_id: str, n: int, concurrency: int, timeout: float
) -> dict[str, dict[str, float]]:
    """Declare a run, create `n` rollouts at once, wait until all have ended; return their status times."""
    spec = {"run_id": run_id, "command": [sys.executable, str(NOOP)], "concurrency": concurrency, "timeout_s": 60}
    (await admin.post("/api/runs", json=spec)).raise_for_status()
    body = {"rollouts": [{"run_id": run_id, "input": {"i": i}} for i in range(n)]}
    (await admin.post("/api/rollouts", json=body)).raise_for_status()
    deadline = time.monotonic() + timeout
    while True:
        times = await status_times(store, run_id)
        ended = sum(1 for t in times.values() if "succeeded" in t or "failed" in t)
        if ended == n:
            return times
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {ended} of {n} rollouts ended within {timeout}s")
        await asyncio.sleep(0.5)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def describe(name: str, values: list[float]) -> str:
    """p50 / p95 / max of a list of seconds, in milliseconds."""
    return (
        f"{name}: p50 {pct(values, 0.5) * 1000:.0f} ms, p95 {pct(values, 0.95) * 1000:.0f} ms, "
        f"max {max(values) * 1000:.0f} ms, mean {statistics.fmean(values) * 1000:.0f} ms"
    )


async def main() -> None:
    """Bring the services up, run the idle probe and the batch, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--idle", type=int, default=5, help="rollouts of the one-at-a-time latency probe")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--show-log", action="store_true", help="print the controller's log at the end")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollwire-bench-controller-") as tmp_name:
        tmp = Path(tmp_name)
        nats = NatsServer(tmp / "nats").start()
        port = free_port()
        gateway_url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "NATS_URL": nats.url,
            "ROLLWIRE_ADMIN_TOKEN": ADMIN,
            "ROLLWIRE_SECRET": "bench-secret",
            "ROLLWIRE_GATEWAY_URL": gateway_url,
            "ROLLWIRE_LOCAL_CAPACITY": str(args.concurrency),
            "PYTHONUNBUFFERED": "1",
        }
        children = [
            start([sys.executable, "-m", "services.gateway", "--port", str(port)], env, tmp / "gateway.log"),
        ]
        store = await EventStore.connect(nats.url)
        admin = httpx.AsyncClient(base_url=gateway_url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
        try:
            wait_http(f"{gateway_url}/healthz")
            children.append(
                start(
                    [
                        sys.executable,
                        *os.environ.get("BENCH_PYTHON_ARGS", "").split(),
                        "-m",
                        "services.controller",
                        "--executions-dir",
                        str(tmp / "executions"),
                    ],
                    env,
                    tmp / "controller.log",
                )
            )
            print(f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}, agent: {NOOP.name}")
            idle: list[float] = []
            launch_idle: list[float] = []
            for i in range(args.idle):
                times = await run_batch(store, admin, f"idle{i}", 1, 1, args.timeout)
                (t,) = times.values()
                idle.append(t["running"] - t["queuing"])
                launch_idle.append(t["running"] - t["preparing"])
            print(describe(f"idle, one rollout at a time ({args.idle}x): queued -> running", idle))
            print(describe("idle: preparing -> running (launch)", launch_idle))
            began = time.monotonic()
            cpu_before = [cpu_s(child.pid) for child in children]
            times = await run_batch(store, admin, "batch", args.rollouts, args.concurrency, args.timeout)
            wall = time.monotonic() - began
            gateway_cpu, controller_cpu = (cpu_s(c.pid) - b for c, b in zip(children, cpu_before, strict=True))
            failed = sum(1 for t in times.values() if "failed" in t)
            running = sorted(t["running"] for t in times.values())
            queued = [t["running"] - t["queuing"] for t in times.values()]
            launch = [t["running"] - t["preparing"] for t in times.values()]
            first_queued = min(t["queuing"] for t in times.values())
            last_end = max(t.get("succeeded", t.get("failed", 0.0)) for t in times.values())
            print(f"batch: {args.rollouts} trivial agents, concurrency {args.concurrency}, {failed} failed")
            print(f"executions started per second: {(len(running) - 1) / (running[-1] - running[0]):.1f}")
            print(f"all {args.rollouts} done in {last_end - first_queued:.2f} s (wall {wall:.2f} s incl. polling)")
            print(describe("queued -> running", queued))
            print(describe("preparing -> running (launch)", launch))
            print(
                f"CPU per execution: controller {controller_cpu / args.rollouts * 1000:.1f} ms, "
                f"gateway {gateway_cpu / args.rollouts * 1000:.1f} ms "
                f"(controller {controller_cpu:.1f} s, gateway {gateway_cpu:.1f} s in all)"
            )
            print(f"load average after: {os.getloadavg()[0]:.1f}")
        finally:
            for child in reversed(children):
                child.terminate()
                try:
                    child.wait(20)
                except subprocess.TimeoutExpired:
                    child.kill()
            if args.show_log:
                print((tmp / "controller.log").read_text()[-20000:])
            await admin.aclose()
            await store.close()
            nats.stop()


if __name__ == "__main__":
    asyncio.run(main())
