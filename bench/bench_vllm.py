"""vLLM, the engine, on the tiny model and a wider one: start time, tokens/s, weight sync.

    PYTHONPATH=. .venv/bin/python bench/bench_vllm.py [--tokens 100] [--in-flight 1,8,32] [--syncs 5]

Builds the tiny model once, then for each model (`vllm`: the tiny one; `vllm-wide`: a
~15M-parameter one of the same family) starts vLLM from `rollwire vllm install`'s environment,
as the stack starts it, and measures the time from process start to `GET /health` = 200, then
aggregate decode tokens/s with 1, 8 and 32 requests in flight (`max_tokens` tokens each,
`ignore_eos`, non-streaming), then the weight sync each training step does (pause ->
reload_weights -> reset_prefix_cache -> update_weight_version -> resume), and counts how many of 8
requests sent during a sync were held until it ended rather than refused. Prints one JSON line per
measurement and a table at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from vllm_server import start_vllm, stop, wait_healthy

from services.common.tinymodel.build import build_tiny_model
from services.common.vllm import VllmReplicas

KEY = "bench-key"
MESSAGES = [{"role": "user", "content": "What is the value of the key river?"}]


async def _one(client: httpx.AsyncClient, tokens: int) -> int:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0}
    answer = await client.post("/v1/chat/completions", json=body)
    answer.raise_for_status()
    return int(answer.json()["usage"]["completion_tokens"])


async def tokens_per_s(url: str, headers: dict[str, str], in_flight: int, tokens: int) -> float:
    """Aggregate completion tokens/s of `in_flight` concurrent requests (after one warm-up request)."""
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600.0) as client:
        await _one(client, 8)
        started = time.perf_counter()
        done = await asyncio.gather(*[_one(client, tokens) for _ in range(in_flight)])
        return sum(done) / (time.perf_counter() - started)


async def sync_times(url: str, model_dir: Path, syncs: int) -> dict[str, Any]:
    """Median seconds per weight sync of the served model, and calls held vs refused during one."""
    replicas = VllmReplicas([url], api_key=KEY)
    out: dict[str, Any] = {}
    try:
        times = []
        for version in range(1, syncs + 1):
            started = time.perf_counter()
            await replicas.reload(model_dir, version)
            times.append(time.perf_counter() - started)
        out["median_s"] = round(sorted(times)[len(times) // 2], 3)
        out["weights_mb"] = round((model_dir / "model.safetensors").stat().st_size / 1e6, 1)
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=600) as client:
            sync = asyncio.create_task(replicas.reload(model_dir, syncs + 1))
            await asyncio.sleep(0.05)
            calls = await asyncio.gather(*[_one(client, 16) for _ in range(8)], return_exceptions=True)
            await sync
        out["held"] = sum(1 for c in calls if isinstance(c, int))
        out["refused"] = sum(1 for c in calls if not isinstance(c, int))
    finally:
        await replicas.close()
    return out


def measure(kind: str, model_dir: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start vLLM on one model, measure it (see the module docstring), stop it."""
    log = root / f"{kind}.log"
    if kind == "vllm-wide":  # a ~15M-parameter model of the same family: weight sync against model size
        model_dir = root / "wide" if (root / "wide").exists() else build_tiny_model(root / "wide", hidden=512, layers=4)
    started = time.perf_counter()
    process, url = start_vllm(model_dir, log, KEY)
    try:
        wait_healthy(process, url, log)
        result: dict[str, Any] = {"engine": kind, "start_s": round(time.perf_counter() - started, 1)}
        headers = {"authorization": f"Bearer {KEY}"}
        for n in args.in_flight:
            result[f"tok_s_{n}"] = round(asyncio.run(tokens_per_s(url, headers, n, args.tokens)), 1)
        if args.syncs:
            result["sync"] = asyncio.run(sync_times(url, model_dir, args.syncs))
    finally:
        stop(process)
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    """Parse the flags, measure each model, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--engines", default="vllm,vllm-wide", help="vllm (the tiny model), vllm-wide, or both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        root = Path(tmp)
        model_dir = build_tiny_model(root / "tiny", seed=0)
        rows = [measure(kind, model_dir, root, args) for kind in args.engines.split(",")]
    for row in rows:
        rates = "  ".join(f"{n} in flight {row[f'tok_s_{n}']:>7} tok/s" for n in args.in_flight)
        print(f"{row['engine']:>9}: start {row['start_s']:>6}s  {rates}  {row.get('sync', '')}")


if __name__ == "__main__":
    main()
