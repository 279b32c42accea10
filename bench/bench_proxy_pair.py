"""Two gateways side by side, this checkout's and another's, in alternating batches of one run.

    python bench/bench_proxy_pair.py ../baseline-checkout [--rounds 10] [--prompt 200] [--calls 3000]

On a machine whose speed drifts (a shared VM's can move by half within a minute), two benches run
one after the other compare the drift, not the trees. Here one nats-server and one fake upstream
serve both gateways (`python -m services.gateway` of this checkout, and of `BASELINE` with its own
`PYTHONPATH`) and Agent Lightning 1.0.2 when its venv exists; each round loads them in turn, the
order flipping every round, with 32 calls in flight on the same prompt, so a slow minute slows
every tree of that round. Printed per round and as medians: the proxy's CPU per call, calls/s, and
the calls/s ratio to Agent Lightning's in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proxy import ADMIN, Stack, gateway_env, proxy_routes, start_run
from proxy_load import Target, chat_body, load, wait_http

from services.devstack.embedded import free_port


def start_baseline(stack: Stack, checkout: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The baseline checkout's gateway on the stack's NATS (its own process, its own code)."""
    port = free_port()
    env = gateway_env(stack.nats.url) | {"PYTHONPATH": str(checkout)}
    log = open(stack.tmp / "baseline.log", "ab")
    argv = [sys.executable, "-m", "services.gateway", "--port", str(port)]
    proc = subprocess.Popen(argv, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=log)
    stack.procs.append(proc)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc)
    return proc, port


def gateway_target(name: str, port: int, pid: int, fake_port: int) -> Target:
    """A run with a calls and tokens budget on the gateway at `port`, and 32 attempts' proxy routes."""
    admin = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
    start_run(admin, fake_port, f"pair-{name}", budget=True)
    return Target(name, port, proxy_routes(admin, port, 32, f"pair-{name}"), pid)


async def rounds(stack: Stack, targets: list[Target], args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """Each round: every gateway in turn (order flipped each round), then Agent Lightning; (CPU us, calls/s)."""
    body = chat_body(args.prompt)
    seen: dict[str, list[list[float]]] = {t.name: [] for t in targets}
    for target in targets:  # warm-up
        await load(target, 32, args.calls // 2, body)
    for index in range(args.rounds):
        order = targets if index % 2 == 0 else targets[::-1]
        if stack.agl is not None:
            order = [*order, Target("agent-lightning", stack.agl_port, stack.agl_round(32), stack.agl.pid)]
        for target in order:
            calls = args.calls if target.name != "agent-lightning" else max(300, args.calls // 6)
            await load(target, 32, min(100, calls), body)
            result = await load(target, 32, calls, body)
            assert result.cpu_s is not None
            row = [result.cpu_s / len(result.latencies) * 1e6, len(result.latencies) / result.seconds]
            seen.setdefault(target.name, []).append(row)
        line = "  ".join(f"{name} {rows[-1][0]:5.0f} us {rows[-1][1]:6.0f}/s" for name, rows in seen.items())
        print(f"round {index + 1:2d}: {line}", flush=True)
    return seen


def report(seen: dict[str, list[list[float]]]) -> dict[str, dict[str, float]]:
    """Print and return each proxy's medians and its calls/s ratio to Agent Lightning's, round by round."""
    agl = seen.get("agent-lightning") or []
    out: dict[str, dict[str, float]] = {}
    for name, rows in seen.items():
        figures = {"cpu_us_per_call": statistics.median(r[0] for r in rows)}
        figures["calls_per_s"] = statistics.median(r[1] for r in rows)
        line = f"{name:16s} median CPU {figures['cpu_us_per_call']:5.0f} us/call, {figures['calls_per_s']:6.0f} calls/s"
        if agl and name != "agent-lightning":
            ratios = [r[1] / a[1] for r, a in zip(rows, agl, strict=False)]
            figures["vs_agent_lightning"] = statistics.median(ratios)
            line += f"; {figures['vs_agent_lightning']:.2f}x Agent Lightning ({min(ratios):.2f}-{max(ratios):.2f})"
        out[name] = figures
        print(line)
    return out


async def main() -> None:
    """Parse the options, start both gateways on one stack, run the rounds and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("baseline", type=Path, help="the other checkout (its root: services/, schemas/)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=200, help="prompt size (characters)")
    parser.add_argument("--calls", type=int, default=3000, help="calls per gateway per round")
    parser.add_argument("--no-agl", action="store_true", help="leave Agent Lightning out")
    parser.add_argument("--json", type=Path, help="also write the rounds and medians to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollwire-pair-") as tmp:
        stack = Stack(Path(tmp))
        try:
            baseline, port = start_baseline(stack, args.baseline.resolve())
            targets = [
                gateway_target("baseline", port, baseline.pid, stack.fake_port),
                gateway_target("this", stack.gw_port, stack.gateway.pid, stack.fake_port),
            ]
            if not args.no_agl:
                stack.start_agl()
            seen = await rounds(stack, targets, args)
            medians = report(seen)
            if args.json:
                args.json.write_text(json.dumps({"rounds": seen, "medians": medians}, indent=1))
        finally:
            stack.close()


if __name__ == "__main__":
    asyncio.run(main())
