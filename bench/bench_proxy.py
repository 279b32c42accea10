"""Proxy overhead: direct to a fake vLLM upstream vs through Rollwire's proxy vs through Agent Lightning's.

    python bench/bench_proxy.py                 # all cases (a few minutes on 2 cores)
    python bench/bench_proxy.py --quick         # fewer calls per case
    python bench/bench_proxy.py --setup-agl     # create the Agent Lightning 1.0.2 venv first

Everything runs on this machine: an embedded nats-server, the fake upstream
(`tests/gateway/fake_vllm.py`, one process), Rollwire's gateway (`python -m services.gateway`,
one process) and, when a Python >= 3.12 venv with `agentlightning==1.0.2` exists, its
`agl-server` on the same upstream (rollouts pre-created, deleted between rounds). The load
generator is a minimal keep-alive HTTP/1.1 client on asyncio, so the client costs little.

Printed: p50/p99 latency and calls/s at 1 and 32 calls in flight with 200-character and
20,000-character prompts; streaming time to first token, direct and proxied; the gateway's
resident memory over 50,000 proxied calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gateway"))

from agl_env import agl_python, setup  # noqa: E402

from services.devstack.embedded import NatsServer, free_port  # noqa: E402

ADMIN = "bench-admin"
# The fake upstream's text pieces are "t<id> ": the first one in Chat Completions, Responses or Messages SSE.
FIRST_TOKEN = (b'"content":"t', b'"delta":"t', b'"text":"t')
RUN = "bench"


# ---- a small keep-alive HTTP/1.1 client ---------------------------------------------------------


class Conn:
    """One keep-alive connection; `call` sends a request and reads the whole response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def call(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, float, float]:
        """(status, seconds to the first content chunk, seconds in all)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        started = time.perf_counter()
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length, chunked = 0, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "transfer-encoding" and "chunked" in value:
                chunked = True
        first = 0.0
        if not chunked:
            await self.reader.readexactly(length)
            first = time.perf_counter() - started
        else:
            while True:
                size = int((await self.reader.readline()).strip(), 16)
                data = await self.reader.readexactly(size + 2)
                if not first and any(marker in data for marker in FIRST_TOKEN):
                    first = time.perf_counter() - started
                if size == 0:
                    break
        return status, first, time.perf_counter() - started


@dataclass
class Target:
    """Where calls go: host, port and per-worker (path, headers)."""

    name: str
    port: int
    routes: list[tuple[str, dict[str, str]]]
    pid: int | None = None  # the proxy's process, whose CPU time per call is reported


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    cpu_s: float | None = None

    def row(self) -> str:
        lat = sorted(self.latencies)
        if not lat:
            return "no successful call"
        p50 = lat[len(lat) // 2] * 1000
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
        rate = len(lat) / self.seconds
        extra = f"  proxy CPU {self.cpu_s / len(lat) * 1e6:5.0f} us/call" if self.cpu_s is not None else ""
        extra += f"  errors {self.errors}" if self.errors else ""
        return f"p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  {rate:8.0f} calls/s{extra}"


def chat_body(prompt_chars: int, stream: bool = False, max_tokens: int = 16) -> bytes:
    text = "".join(random.choice("abcdefghij klmnop") for _ in range(prompt_chars))
    return json.dumps(
        {
            "model": "fake-model",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()


async def load(target: Target, concurrency: int, calls: int, body: bytes) -> Result:
    """`calls` calls with `concurrency` in flight, each worker on its own connection and route."""
    result = Result()
    remaining = calls

    async def worker(index: int) -> None:
        nonlocal remaining
        conn = Conn("127.0.0.1", target.port)
        path, headers = target.routes[index % len(target.routes)]
        headers = {**headers, "content-type": "application/json"}
        while remaining > 0:
            remaining -= 1
            status, first, total = await conn.call("POST", path, headers, body)
            if status == 200:
                result.latencies.append(total)
                result.firsts.append(first)
            else:
                result.errors += 1
        if conn.writer is not None:
            conn.writer.close()

    cpu = cpu_seconds(target.pid) if target.pid else 0.0
    started = time.perf_counter()
    await asyncio.gather(*[worker(i) for i in range(concurrency)])
    result.seconds = time.perf_counter() - started
    if target.pid:
        result.cpu_s = cpu_seconds(target.pid) - cpu
    return result


# ---- processes -------------------------------------------------------------------------------


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Stack:
    """nats-server, the fake upstream, Rollwire's gateway and (when available) Agent Lightning's server."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.nats = NatsServer(tmp / "nats").start()
        self.fake_port = free_port()
        self.fake = self._spawn(
            [sys.executable, str(ROOT / "tests/gateway/fake_vllm.py"), "--port", str(self.fake_port)]
        )
        wait_http(f"http://127.0.0.1:{self.fake_port}/v1/models", self.fake)
        self.gw_port = free_port()
        env = {
            **os.environ,
            "ROLLWIRE_ADMIN_TOKEN": ADMIN,
            "ROLLWIRE_SECRET": "bench-secret",
            "NATS_URL": self.nats.url,
        }
        self.gateway = self._spawn([sys.executable, "-m", "services.gateway", "--port", str(self.gw_port)], env=env)
        wait_http(f"http://127.0.0.1:{self.gw_port}/healthz", self.gateway)
        self.admin = httpx.Client(
            base_url=f"http://127.0.0.1:{self.gw_port}", headers={"authorization": f"Bearer {ADMIN}"}, timeout=60
        )
        self.agl: subprocess.Popen[bytes] | None = None
        self.agl_port = 0
        self.agl_reason = ""

    def _spawn(
        self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            argv,
            cwd=cwd or ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / f"{len(self.procs)}.log", "ab"),
        )
        self.procs.append(proc)
        return proc

    def rollwire_routes(self, count: int) -> list[tuple[str, dict[str, str]]]:
        self.admin.post(
            "/api/models", json={"name": "fake", "run_id": RUN, "base_url": f"http://127.0.0.1:{self.fake_port}/v1"}
        ).raise_for_status()
        created = self.admin.post(
            "/api/rollouts", json={"rollouts": [{"run_id": RUN, "input": i} for i in range(count)]}
        )
        created.raise_for_status()
        routes = []
        for rollout in created.json()["rollouts"]:
            attempt = self.admin.post(f"/api/rollouts/{rollout['rollout_id']}/attempts").json()
            path = attempt["proxy_base_url"].split(str(self.gw_port), 1)[1] + "/chat/completions"
            routes.append((path, {"authorization": f"Bearer {attempt['token']}"}))
        return routes

    def start_agl(self) -> None:
        python, reason = agl_python()
        if python is None:
            self.agl_reason = reason
            return
        self.agl_port = free_port()
        workdir = self.tmp / "agl"
        workdir.mkdir()
        self.agl = self._spawn(
            [
                str(python),
                "-m",
                "agentlightning.server",
                f"port={self.agl_port}",
                "host=127.0.0.1",
                f"key={ADMIN}",
                "default_proxy.model_name=fake-model",
                "hydra.run.dir=.",
                "hydra.output_subdir=null",
                "hydra/job_logging=disabled",
                "hydra/hydra_logging=disabled",
            ],
            cwd=workdir,
        )
        wait_http(f"http://127.0.0.1:{self.agl_port}/healthz", self.agl)
        httpx.post(
            f"http://127.0.0.1:{self.agl_port}/api/models",
            headers={"authorization": f"Bearer {ADMIN}"},
            json=[{"model": "fake-model", "endpoint": f"http://127.0.0.1:{self.fake_port}/v1"}],
        ).raise_for_status()

    def agl_round(self, count: int) -> list[tuple[str, dict[str, str]]]:
        """Fresh Agent Lightning rollouts for one round (the previous round's are deleted)."""
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{self.agl_port}", headers={"authorization": f"Bearer {ADMIN}"}
        )
        for rollout in client.get("/api/rollouts", params=[("state_in", "queuing"), ("limit", 100000)]).json():
            client.delete(f"/api/rollouts/{rollout['rollout_id']}")
        created = client.post("/api/rollouts", json=[{"input": i} for i in range(count)]).json()
        return [
            (
                f"/proxy/rollout/{r['rollout_id']}/attempt/0/mode/train/openai/v1/chat/completions",
                {"authorization": f"Bearer {ADMIN}"},
            )
            for r in created
        ]

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.nats.stop()


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="rollwire-bench-") as tmp:
        stack = Stack(Path(tmp))
        try:
            await measure(stack, args)
        finally:
            stack.close()


async def measure(stack: Stack, args: argparse.Namespace) -> None:
    scale = 0.2 if args.quick else 1.0
    direct = Target("direct", stack.fake_port, [("/v1/chat/completions", {})])
    rollwire = Target("rollwire", stack.gw_port, stack.rollwire_routes(32), stack.gateway.pid)
    stack.start_agl()
    print(f"fake upstream :{stack.fake_port}  rollwire gateway :{stack.gw_port}  nats {stack.nats.url}")
    print(f"load average before the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if stack.agl is None:
        print(f"agent lightning: skipped ({stack.agl_reason})")
    print()
    table: dict[tuple[str, int, int], Result] = {}
    for prompt in (200, 20_000):
        for concurrency in (1, 32):
            calls = int((600 if concurrency == 1 else 4000) * scale * (0.5 if prompt > 1000 else 1))
            body = chat_body(prompt)
            targets = [direct, rollwire]
            if stack.agl is not None:
                targets.append(Target("agent-lightning", stack.agl_port, stack.agl_round(32), stack.agl.pid))
            for target in targets:
                await load(target, concurrency, max(50, calls // 10), body)  # warm-up
                result = await load(target, concurrency, calls, body)
                table[(target.name, concurrency, prompt)] = result
                print(f"{target.name:16s} in flight {concurrency:2d}  prompt {prompt:6d} chars  {result.row()}")
            print()
    summarize(table)

    body = chat_body(200, stream=True)
    print("streaming, 1 in flight, 200-char prompt, 16 tokens (time to first token):")
    ttft = {}
    for target in (direct, rollwire):
        await load(target, 1, 50, body)
        result = await load(target, 1, int(400 * scale), body)
        ttft[target.name] = statistics.median(result.firsts) * 1000
        print(f"  {target.name:16s} TTFT p50 {ttft[target.name]:6.2f} ms   total {result.row()}")
    print(f"  added by the proxy: {ttft['rollwire'] - ttft['direct']:+.2f} ms (target <= +1 ms)\n")

    total = int(50_000 * (0.2 if args.quick else 1.0))
    body = chat_body(200)
    print(f"gateway memory over {total} proxied calls (32 in flight):")
    step = total // 10
    for done in range(0, total, step):
        result = await load(rollwire, 32, step, body)
        print(f"  after {done + step:6d} calls: RSS {rss_kib(stack.gateway.pid) / 1024:7.1f} MiB   {result.row()}")


def summarize(table: dict[tuple[str, int, int], Result]) -> None:
    def rate(name: str, c: int, p: int) -> float:
        r = table.get((name, c, p))
        return len(r.latencies) / r.seconds if r and r.latencies else float("nan")

    def p50(name: str, c: int, p: int) -> float:
        r = table[(name, c, p)]
        return sorted(r.latencies)[len(r.latencies) // 2] * 1000

    print("against the targets:")
    for prompt in (200, 20_000):
        ratio = rate("rollwire", 32, prompt) / rate("direct", 32, prompt)
        added = p50("rollwire", 1, prompt) - p50("direct", 1, prompt)
        line = f"  {prompt:6d}-char prompt: throughput at 32 in flight {ratio:.2f}x direct (target >= 0.8x); "
        line += f"p50 at 1 in flight {added:+.2f} ms (target <= +1 ms)"
        if ("agent-lightning", 32, prompt) in table:
            line += f"; {rate('rollwire', 32, prompt) / rate('agent-lightning', 32, prompt):.2f}x Agent Lightning"
        print(line)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer calls per case")
    parser.add_argument("--setup-agl", action="store_true", help="create the Agent Lightning 1.0.2 venv first")
    args = parser.parse_args()
    if args.setup_agl and agl_python()[0] is None:
        print(f"Agent Lightning venv: {setup()}")
    try:
        import uvloop

        uvloop.run(run(args))
    except ImportError:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
