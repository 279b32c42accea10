"""The proxy bench's load generator: a minimal keep-alive HTTP/1.1 client on asyncio, the figures of a
case, and the process probes (CPU time and resident memory from /proc). Used by `bench_proxy.py`
and `bench_frontends.py`."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# The fake upstream's text pieces are "t<id> ": the first one in Chat Completions, Responses or Messages SSE.
FIRST_TOKEN = (b'"content":"t', b'"delta":"t', b'"text":"t')


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

    def figures(self) -> dict[str, float | int | None]:
        """The row's figures for `--json` (ms, calls/s, proxy CPU in us per call)."""
        lat = sorted(self.latencies)
        if not lat:
            return {"calls": 0, "errors": self.errors}
        return {
            "calls": len(lat),
            "errors": self.errors,
            "p50_ms": lat[len(lat) // 2] * 1000,
            "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
            "calls_per_s": len(lat) / self.seconds,
            "ttft_p50_ms": statistics.median(self.firsts) * 1000 if self.firsts else None,
            "cpu_us_per_call": self.cpu_s / len(lat) * 1e6 if self.cpu_s is not None else None,
        }


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
