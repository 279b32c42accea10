"""Throughput and time to first token of the embedded engine serving the tiny model.

    .venv/bin/python bench/bench_engine.py [--threads 1] [--tokens 256]

Starts `python -m services.engine` as a subprocess on a free port (so the client does not share
the server's GIL) and prints, measured with a light httpx SSE client (the openai SDK's per-chunk
parsing would otherwise compete with the server for the CPUs and be measured too):
- single stream: time to first token (short and ~1000-token prompts) and decode tokens/s;
- non-streaming request latency and tokens/s;
- aggregate tokens/s with 4 and 8 concurrent streams, and with n=4 choices in one request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from services.common.tinymodel.build import build_tiny_model
from services.devstack.embedded import free_port

SHORT = [{"role": "user", "content": "Say hello."}]
LONG = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 90}]


async def _stream_once(
    client: httpx.AsyncClient, messages: list[dict[str, str]], tokens: int, n: int = 1
) -> tuple[float, float, int]:
    """(seconds to first token, total seconds, tokens received) of one streamed request."""
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": tokens,
        "n": n,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    started = time.perf_counter()
    first = 0.0
    received = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                got = len(choice.get("token_ids") or [])
                if got and not first:
                    first = time.perf_counter() - started
                received += got
    return first, time.perf_counter() - started, received


async def _bench(base_url: str, tokens: int) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await _stream_once(client, SHORT, 16)  # warm-up
        runs = [await _stream_once(client, SHORT, tokens) for _ in range(3)]
        ttft = statistics.median(r[0] for r in runs)
        decode = statistics.median((r[2] - 1) / (r[1] - r[0]) for r in runs)
        print(f"single stream, short prompt: TTFT {ttft * 1000:.1f} ms, decode {decode:.0f} tokens/s")
        long_runs = [await _stream_once(client, LONG, 32) for _ in range(3)]
        prompt = await client.post("/v1/chat/completions", json={"messages": LONG, "max_tokens": 1})
        prompt_tokens = prompt.json()["usage"]["prompt_tokens"]
        long_ttft = statistics.median(r[0] for r in long_runs)
        print(f"single stream, {prompt_tokens}-token prompt: TTFT {long_ttft * 1000:.1f} ms")

        started = time.perf_counter()
        whole = await client.post(
            "/v1/chat/completions", json={"messages": SHORT, "max_tokens": tokens, "ignore_eos": True}
        )
        elapsed = time.perf_counter() - started
        done = whole.json()["usage"]["completion_tokens"]
        print(f"non-streaming, {done} tokens: {elapsed * 1000:.0f} ms ({done / elapsed:.0f} tokens/s)")

        for concurrent in (4, 8):
            started = time.perf_counter()
            results = await asyncio.gather(*[_stream_once(client, SHORT, tokens) for _ in range(concurrent)])
            elapsed = time.perf_counter() - started
            total = sum(r[2] for r in results)
            ttfts = sorted(r[0] for r in results)
            print(
                f"{concurrent} concurrent streams: {total / elapsed:.0f} tokens/s aggregate, "
                f"TTFT median {statistics.median(ttfts) * 1000:.0f} ms, max {ttfts[-1] * 1000:.0f} ms"
            )
        first, elapsed, total = await _stream_once(client, SHORT, tokens, n=4)
        print(f"one request with n=4: {total / elapsed:.0f} tokens/s aggregate, TTFT {first * 1000:.0f} ms")


def _raw_loop(model_dir: Path, tokens: int, threads: int) -> None:
    """Tokens/s of the batched token loop itself, in this process, without HTTP (the server's ceiling)."""
    import torch

    from services.common.tinymodel.tokenizer import TokenTable, load_tokenizer
    from services.engine.generation import Batch, Generation
    from services.engine.output import ChoiceBuilder
    from services.engine.sampling import SamplingParams
    from services.engine.weights import load_weights

    torch.set_num_threads(threads)
    weights = load_weights(model_dir, 0)
    table = TokenTable.build(load_tokenizer(model_dir), weights.vocab_size)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for rows in (1, 8):
        rates = []
        for attempt in range(3):
            batch = Batch(weights)
            started = time.perf_counter()
            with torch.inference_mode():
                for request in range(rows):
                    builders = [ChoiceBuilder(0, table, params, frozenset(), False, True)]
                    generators = [torch.Generator().manual_seed(attempt * 100 + request)]
                    batch.admit(request, Generation(list(range(10, 20 + request)), params, builders, generators))
                while batch.rows:
                    batch.step()
            rates.append(rows * tokens / (time.perf_counter() - started))
        print(f"token loop in-process (no HTTP), {rows} request(s): {statistics.median(rates):.0f} tokens/s")


def main() -> None:
    """Build the tiny model, start the engine, run the measurements, stop the engine."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine process")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        port = free_port()
        command = [sys.executable, "-m", "services.engine", "--model", str(model), "--port", str(port)]
        command += ["--served-name", "tiny", "--threads", str(args.threads)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base_url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    httpx.get(base_url + "/health", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("the engine did not start") from None
                    time.sleep(0.2)
            load = os.getloadavg()[0]
            print(f"tiny model, engine with {args.threads} torch thread(s), {os.cpu_count()} CPUs, load {load:.1f}")
            asyncio.run(_bench(base_url, args.tokens))
            _raw_loop(model, args.tokens, args.threads)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
