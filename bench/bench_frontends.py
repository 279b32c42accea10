"""The proxy's three front ends side by side: Chat Completions, the Responses API, Anthropic Messages.

    python bench/bench_frontends.py            # about a minute on 2 cores
    python bench/bench_frontends.py --quick    # fewer calls

One run, one stack (embedded nats-server, the fake vLLM upstream, one gateway process; see
`bench_proxy.py`). The same 200-character prompt goes through each front end in turn, round after
round, so drift in the machine's load hits all three alike. Printed per front end: p50 latency
and the gateway's CPU time per call at 1 call in flight (non-streamed, 16 tokens), streaming time
to first token (p50), and what each adds over the chat path; the direct upstream is the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import RUN, Result, Stack, Target, load

ENDPOINTS = {
    "chat": "/openai/v1/chat/completions",
    "responses": "/openai/v1/responses",
    "messages": "/anthropic/v1/messages",
}


def body(api: str, text: str, stream: bool) -> bytes:
    """The same request in each API's shape (16 tokens)."""
    if api == "chat":
        request = {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    elif api == "responses":
        request = {"model": "fake", "input": text, "max_output_tokens": 16}
    else:
        request = {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    return json.dumps({**request, "stream": stream}).encode()


def targets(stack: Stack) -> dict[str, Target]:
    """One target per front end, each on the same attempts' base paths."""
    stack.start_run(RUN, budget=False)
    bases = [(path.removesuffix(ENDPOINTS["chat"]), headers) for path, headers in stack.rollwire_routes(8)]
    out = {api: Target(api, stack.gw_port, [(b + suffix, h) for b, h in bases], stack.gateway.pid)
           for api, suffix in ENDPOINTS.items()}  # fmt: skip
    out["direct"] = Target("direct", stack.fake_port, [("/v1/chat/completions", {})])
    return out


def merge(into: Result, part: Result) -> None:
    into.latencies += part.latencies
    into.firsts += part.firsts
    into.errors += part.errors
    into.seconds += part.seconds
    into.cpu_s = (into.cpu_s or 0.0) + (part.cpu_s or 0.0) if part.cpu_s is not None else into.cpu_s


async def rounds(all_targets: dict[str, Target], text: str, stream: bool, calls: int) -> dict[str, Result]:
    """`calls` calls per front end at 1 in flight, in 10 interleaved rounds."""
    results = {name: Result() for name in all_targets}
    for name, target in all_targets.items():  # warm-up
        await load(target, 1, 30, body("chat" if name == "direct" else name, text, stream))
    for _ in range(10):
        for name, target in all_targets.items():
            part = await load(target, 1, calls // 10, body("chat" if name == "direct" else name, text, stream))
            merge(results[name], part)
    return results


def p50_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


async def measure(stack: Stack, quick: bool) -> None:
    calls = 300 if quick else 1500
    all_targets = targets(stack)
    text = "".join(random.choice("abcdefghij klmnop") for _ in range(200))
    print(f"load average before the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {calls} calls per case\n")
    plain = await rounds(all_targets, text, False, calls)
    streamed = await rounds(all_targets, text, True, calls)
    chat_p50, chat_cpu = p50_ms(plain["chat"].latencies), _cpu_us(plain["chat"])
    chat_ttft = p50_ms(streamed["chat"].firsts)
    print(f"{'front end':10s} {'p50 ms':>8s} {'+chat ms':>9s} {'CPU us/call':>12s} {'+chat us':>9s} "
          f"{'TTFT p50 ms':>12s} {'+chat ms':>9s} {'errors':>7s}")  # fmt: skip
    for name in ("direct", "chat", "responses", "messages"):
        p50, cpu, ttft = p50_ms(plain[name].latencies), _cpu_us(plain[name]), p50_ms(streamed[name].firsts)
        errors = plain[name].errors + streamed[name].errors
        cpu_cells = f"{cpu:12.0f} {cpu - chat_cpu:+9.0f}" if name != "direct" else f"{'-':>12s} {'-':>9s}"
        print(
            f"{name:10s} {p50:8.2f} {p50 - chat_p50:+9.2f} {cpu_cells} "
            f"{ttft:12.2f} {ttft - chat_ttft:+9.2f} {errors:7d}"
        )


def _cpu_us(result: Result) -> float:
    return (result.cpu_s or 0.0) / max(1, len(result.latencies)) * 1e6 if result.cpu_s is not None else float("nan")


async def run(quick: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="rollwire-bench-") as tmp:
        stack = Stack(Path(tmp))
        try:
            await measure(stack, quick)
        finally:
            stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer calls per case")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(run(args.quick))
    except ImportError:
        asyncio.run(run(args.quick))


if __name__ == "__main__":
    main()
