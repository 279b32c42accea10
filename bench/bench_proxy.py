"""Proxy overhead: direct to a fake vLLM upstream vs through Rollwire's proxy vs through Agent Lightning's.

    python bench/bench_proxy.py                 # all cases (a few minutes on 2 cores)
    python bench/bench_proxy.py --quick         # fewer calls per case
    python bench/bench_proxy.py --setup-agl     # create the Agent Lightning 1.0.2 venv first
    python bench/bench_proxy.py --gateway-python other-venv/bin/python   # the gateway on another interpreter

Everything runs on this machine: an embedded nats-server, the fake upstream
(`tests/services/gateway/fake_vllm.py`, one process), Rollwire's gateway (`python -m services.gateway`,
one process) and, when a Python >= 3.12 venv with `agentlightning==1.0.2` exists, its
`agl-server` on the same upstream (rollouts pre-created, deleted between rounds). The load
generator is a minimal keep-alive HTTP/1.1 client on asyncio, so the client costs little.

Printed: p50/p99 latency and calls/s at 1 and 32 calls in flight with 200-character and
20,000-character prompts; streaming time to first token, direct and proxied; the gateway's
resident memory over 50,000 proxied calls; the interpreter each proxy runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "services" / "gateway"))
sys.path.insert(0, str(ROOT / "bench"))

from agl_env import agl_python, setup  # noqa: E402
from proxy_load import Result, Target, chat_body, load, rss_kib, wait_http  # noqa: E402

from services.devstack.embedded import NatsServer, free_port  # noqa: E402

ADMIN = "bench-admin"
RUN = "bench"


def gateway_env(nats_url: str) -> dict[str, str]:
    """The environment a bench gateway runs with: the bench's admin token and secret, on `nats_url`."""
    return {**os.environ, "ROLLWIRE_ADMIN_TOKEN": ADMIN, "ROLLWIRE_SECRET": "bench-secret", "NATS_URL": nats_url}


def start_run(
    admin: httpx.Client,
    fake_port: int,
    run_id: str,
    budget: bool,
    prompt_mode: str = "exact",
    tokenizer: str | None = None,
) -> None:
    """Start a run (a calls and tokens budget when asked, beside the default bytes budget) and register
    the fake model for it (with its tokenizer's directory, which continuous prompt mode renders with)."""
    spec: dict[str, Any] = {"run_id": run_id, "command": ["true"], "prompt_mode": prompt_mode}
    if budget:
        spec["budget"] = {"calls": 2_000_000_000, "tokens": 2_000_000_000}
    admin.post("/api/runs", json=spec).raise_for_status()
    model = {"name": "fake", "run_id": run_id, "base_url": f"http://127.0.0.1:{fake_port}/v1"}
    admin.post("/api/models", json=model | ({"tokenizer": tokenizer} if tokenizer else {})).raise_for_status()


def proxy_routes(admin: httpx.Client, port: int, count: int, run_id: str) -> list[tuple[str, dict[str, str]]]:
    """`count` rollouts of the run, one attempt each: their chat proxy paths and tokens on the gateway at `port`."""
    created = admin.post("/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": i} for i in range(count)]})
    created.raise_for_status()
    routes = []
    for rollout in created.json()["rollouts"]:
        attempt = admin.post(f"/api/rollouts/{rollout['rollout_id']}/attempts").json()
        path = attempt["proxy_base_url"].split(str(port), 1)[1] + "/chat/completions"
        routes.append((path, {"authorization": f"Bearer {attempt['token']}"}))
    return routes


class Stack:
    """nats-server, the fake upstream, Rollwire's gateway and (when available) Agent Lightning's server."""

    def __init__(self, tmp: Path, profile: Path | None = None, python: str | None = None) -> None:
        self.tmp = tmp
        self.profile = profile
        self.procs: list[subprocess.Popen[bytes]] = []
        self.nats = NatsServer(tmp / "nats").start()
        self.fake_port = free_port()
        self.fake = self._spawn(
            [sys.executable, str(ROOT / "tests/services/gateway/fake_vllm.py"), "--port", str(self.fake_port)]
        )
        wait_http(f"http://127.0.0.1:{self.fake_port}/v1/models", self.fake)
        self.gw_port = free_port()
        env = gateway_env(self.nats.url)
        python = python or sys.executable
        argv = [python, "-m", "services.gateway"]
        if profile is not None:  # cProfile in the gateway, switched on around each measured case
            argv = [python, str(ROOT / "bench" / "profiled_gateway.py"), str(profile)]
        self.gateway = self._spawn([*argv, "--port", str(self.gw_port)], env=env)
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

    def start_run(self, run_id: str, budget: bool, prompt_mode: str = "exact", tokenizer: str | None = None) -> None:
        """`start_run` on this stack's gateway and fake model."""
        start_run(self.admin, self.fake_port, run_id, budget, prompt_mode, tokenizer)

    def rollwire_routes(self, count: int, run_id: str = RUN) -> list[tuple[str, dict[str, str]]]:
        """`proxy_routes` of this stack's gateway."""
        return proxy_routes(self.admin, self.gw_port, count, run_id)

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


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rollwire-bench-") as tmp:
        stack = Stack(Path(tmp), args.profile, args.gateway_python)
        try:
            return await measure(stack, args)
        finally:
            stack.close()


class Profiled:
    """Profiles one measured case in the gateway (`profiled_gateway.py`) into `<dir>/<case>.prof`."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.count = stack, 0

    def start(self) -> None:
        if self.stack.profile is not None:
            os.kill(self.stack.gateway.pid, signal.SIGUSR1)

    def stop(self, case: str) -> None:
        if self.stack.profile is None:
            return
        os.kill(self.stack.gateway.pid, signal.SIGUSR2)
        written = self.stack.profile / f"{self.count}.prof"
        deadline = time.monotonic() + 60
        while not written.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # let the dump finish
        written.rename(self.stack.profile / f"{case}.prof")
        self.count += 1


async def measure(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    scale = args.scale * (0.2 if args.quick else 1.0)
    sections = set(args.sections.split(","))
    stack.start_run(RUN, args.budget)
    # The direct path is measured on the fake upstream's own CPU: the yardstick of the proxy's CPU per call.
    direct = Target("direct", stack.fake_port, [("/v1/chat/completions", {})], stack.fake.pid)
    rollwire = Target("rollwire", stack.gw_port, stack.rollwire_routes(32), stack.gateway.pid)
    if not args.no_agl and "main" in sections:
        stack.start_agl()
    else:
        stack.agl_reason = "not asked for"
    load_before = os.getloadavg()[0]
    print(f"fake upstream :{stack.fake_port}  rollwire gateway :{stack.gw_port}  nats {stack.nats.url}")
    print(f"load average before the run: {load_before:.1f} on {os.cpu_count()} CPUs")
    print(f"budget on the run: {'calls and tokens' if args.budget else 'none'}")
    if stack.agl is None:
        print(f"agent lightning: skipped ({stack.agl_reason})")
    interpreters = {"rollwire": interpreter(stack.gateway.pid)}
    if stack.agl is not None:
        interpreters["agent-lightning"] = interpreter(stack.agl.pid)
    for name, build in interpreters.items():
        print(f"{name} runs on {build}")
    print()
    figures: dict[str, Any] = {
        "load_before": load_before,
        "cpus": os.cpu_count(),
        "budget": args.budget,
        "interpreters": interpreters,
        "cases": {},
    }
    profiled = Profiled(stack)
    table: dict[tuple[str, int, int], Result] = {}
    if "main" in sections:
        for prompt in args.prompts:
            for concurrency in args.in_flight:
                calls = int((600 if concurrency == 1 else 4000) * scale * (0.5 if prompt > 1000 else 1))
                body = chat_body(prompt)
                targets = [direct, rollwire]
                if stack.agl is not None:
                    targets.append(Target("agent-lightning", stack.agl_port, stack.agl_round(32), stack.agl.pid))
                for target in targets:
                    await load(target, concurrency, max(50, calls // 10), body)  # warm-up
                    case = f"chat-exact-{target.name}-c{concurrency}-p{prompt}"
                    if target is rollwire:
                        profiled.start()
                    result = await load(target, concurrency, max(50, calls), body)
                    if target is rollwire:
                        profiled.stop(case)
                    table[(target.name, concurrency, prompt)] = result
                    figures["cases"][case] = result.figures()
                    print(f"{target.name:16s} in flight {concurrency:2d}  prompt {prompt:6d} chars  {result.row()}")
                print()
        figures["summary"] = summarize(table)
    if "apis" in sections:
        figures["cases"].update(await front_ends(stack, direct, scale, args, profiled))
    if "stream" in sections:
        figures["ttft"] = await streaming(direct, rollwire, scale)
    if "memory" in sections:
        await memory(stack, rollwire, args)
    figures["load_after"] = os.getloadavg()[0]
    return figures


ENDPOINTS = {
    "chat": "/openai/v1/chat/completions",
    "responses": "/openai/v1/responses",
    "messages": "/anthropic/v1/messages",
}


def api_body(api: str, prompt_chars: int, stream: bool = False) -> bytes:
    """The same request (a user message, 16 tokens) in each front end's shape."""
    text = "".join(random.choice("abcdefghij klmnop") for _ in range(prompt_chars))
    if api == "responses":
        request: dict[str, Any] = {"model": "fake", "input": text, "max_output_tokens": 16}
    else:
        request = {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    return json.dumps({**request, "stream": stream}).encode()


async def front_ends(
    stack: Stack, direct: Target, scale: float, args: argparse.Namespace, profiled: Profiled
) -> dict[str, Any]:
    """Each front end in each prompt mode: 32 in flight (calls/s, proxy CPU per call) and 1 in flight (p50)."""
    modes = {"exact": RUN}
    stack.start_run(f"{RUN}-continuous", args.budget, "continuous", continuous_tokenizer())
    modes["continuous"] = f"{RUN}-continuous"
    cases: dict[str, Any] = {}
    print("front ends and prompt modes (proxy vs direct; direct is the same chat request):")
    for mode, run_id in modes.items():
        bases = [(path.removesuffix(ENDPOINTS["chat"]), h) for path, h in stack.rollwire_routes(32, run_id)]
        for api, suffix in ENDPOINTS.items():
            target = Target(f"{api}-{mode}", stack.gw_port, [(b + suffix, h) for b, h in bases], stack.gateway.pid)
            for prompt in args.prompts:
                for concurrency in args.in_flight:
                    calls = max(50, int((300 if concurrency == 1 else 2000) * scale * (0.5 if prompt > 1000 else 1)))
                    body = api_body(api, prompt)
                    await load(target, concurrency, max(50, calls // 10), body)
                    case = f"api-{api}-{mode}-rollwire-c{concurrency}-p{prompt}"
                    profiled.start()
                    result = await load(target, concurrency, calls, body)
                    profiled.stop(case)
                    cases[case] = result.figures()
                    print(f"  {target.name:20s} in flight {concurrency:2d}  prompt {prompt:6d}  {result.row()}")
    for prompt in args.prompts:
        for concurrency in args.in_flight:
            calls = max(50, int((300 if concurrency == 1 else 2000) * scale * (0.5 if prompt > 1000 else 1)))
            result = await load(direct, concurrency, calls, chat_body(prompt))
            cases[f"api-direct-c{concurrency}-p{prompt}"] = result.figures()
            print(f"  {'direct':20s} in flight {concurrency:2d}  prompt {prompt:6d}  {result.row()}")
    print()
    return cases


def continuous_tokenizer() -> str:
    """A model directory with a tokenizer and chat template for continuous mode: ROLLWIRE_BENCH_TOKENIZER,
    else the default tiny model (built on first use, the one `rollwire up` serves), so the mode is
    always measured."""
    explicit = os.environ.get("ROLLWIRE_BENCH_TOKENIZER")
    if explicit:
        return explicit
    from services.common.tinymodel.build import ensure_tiny_model

    return str(ensure_tiny_model())


async def streaming(direct: Target, rollwire: Target, scale: float) -> dict[str, float]:
    """Time to first token at 1 in flight, direct and through the proxy (ms, p50)."""
    body = chat_body(200, stream=True)
    print("streaming, 1 in flight, 200-char prompt, 16 tokens (time to first token):")
    ttft = {}
    for target in (direct, rollwire):
        await load(target, 1, 50, body)
        result = await load(target, 1, max(50, int(400 * scale)), body)
        ttft[target.name] = statistics.median(result.firsts) * 1000
        print(f"  {target.name:16s} TTFT p50 {ttft[target.name]:6.2f} ms   total {result.row()}")
    ttft["added_ms"] = ttft["rollwire"] - ttft["direct"]
    print(f"  added by the proxy: {ttft['added_ms']:+.2f} ms (target <= +0.6 ms)\n")
    return ttft


async def memory(stack: Stack, rollwire: Target, args: argparse.Namespace) -> None:
    total = int(50_000 * (0.2 if args.quick else 1.0))
    body = chat_body(200)
    print(f"gateway memory over {total} proxied calls (32 in flight):")
    step = total // 10
    for done in range(0, total, step):
        result = await load(rollwire, 32, step, body)
        print(f"  after {done + step:6d} calls: RSS {rss_kib(stack.gateway.pid) / 1024:7.1f} MiB   {result.row()}")


def summarize(table: dict[tuple[str, int, int], Result]) -> dict[str, Any]:
    """Print and return the figures against the targets (ratios to direct and to Agent Lightning)."""

    def rate(name: str, c: int, p: int) -> float:
        r = table.get((name, c, p))
        return len(r.latencies) / r.seconds if r and r.latencies else float("nan")

    def p50(name: str, c: int, p: int) -> float:
        r = table.get((name, c, p))
        return sorted(r.latencies)[len(r.latencies) // 2] * 1000 if r and r.latencies else float("nan")

    print("against the targets:")
    out: dict[str, Any] = {}
    for prompt in sorted({p for _, _, p in table}):
        row: dict[str, float] = {}
        line = f"  {prompt:6d}-char prompt:"
        proxy = table.get(("rollwire", 32, prompt))
        if proxy is not None and proxy.cpu_s is not None and proxy.latencies:
            row["cpu_us_per_call"] = proxy.cpu_s / len(proxy.latencies) * 1e6
            row["throughput_vs_direct"] = rate("rollwire", 32, prompt) / rate("direct", 32, prompt)
            line += f" proxy CPU {row['cpu_us_per_call']:.0f} us/call at 32 in flight;"
            line += f" throughput {row['throughput_vs_direct']:.2f}x direct"
        if ("rollwire", 1, prompt) in table:
            row["added_p50_ms"] = p50("rollwire", 1, prompt) - p50("direct", 1, prompt)
            line += f"; p50 at 1 in flight {row['added_p50_ms']:+.2f} ms"
        if ("agent-lightning", 32, prompt) in table:
            row["vs_agent_lightning"] = rate("rollwire", 32, prompt) / rate("agent-lightning", 32, prompt)
            line += f"; {row['vs_agent_lightning']:.2f}x Agent Lightning"
        out[str(prompt)] = row
        print(line)
    print()
    return out


def interpreter(pid: int) -> str:
    """The Python a proxy process runs on, and whether its interpreter is a shared libpython: the
    interpreter's build moves the CPU per call (the gateway README has the figures)."""
    exe = Path(f"/proc/{pid}/exe").resolve()
    version = subprocess.run([exe, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True)
    maps = Path(f"/proc/{pid}/maps").read_text()
    shared = next((line.rsplit("/", 1)[1] for line in maps.splitlines() if "/libpython" in line), None)
    where = f"{shared} loaded" if shared else "the interpreter linked into its executable"
    return f"Python {version.stdout.strip()} ({exe}; {where})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer calls per case")
    parser.add_argument("--setup-agl", action="store_true", help="create the Agent Lightning 1.0.2 venv first")
    parser.add_argument("--no-agl", action="store_true", help="leave Agent Lightning out")
    parser.add_argument("--json", type=Path, help="also write the figures to this file as JSON")
    parser.add_argument("--profile", type=Path, help="cProfile the gateway in each measured case into this folder")
    parser.add_argument("--sections", default="main,apis,stream,memory", help="which parts to run (comma-separated)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of calls per case")
    parser.add_argument("--prompts", type=int, nargs="+", default=[200, 20_000], help="prompt sizes (characters)")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 32], help="calls in flight")
    parser.add_argument("--no-budget", dest="budget", action="store_false", help="run without an attempt budget")
    parser.add_argument(
        "--gateway-python", help="the interpreter of Rollwire's gateway (a venv's python with this checkout installed)"
    )
    args = parser.parse_args()
    if args.setup_agl and agl_python()[0] is None:
        print(f"Agent Lightning venv: {setup()}")
    try:
        import uvloop

        figures = uvloop.run(run(args))
    except ImportError:
        figures = asyncio.run(run(args))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2, allow_nan=True))


if __name__ == "__main__":
    main()
