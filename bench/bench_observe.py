"""What metrics and access logs cost per request, against the same app without them.

    .venv/bin/python bench/bench_observe.py [--requests 20000]

In one process, no sockets (so only our code is measured): a FastAPI route like the gateway's GETs
and a bare ASGI handler like the proxy, each called directly with ASGI messages, plain and wrapped
in `ObservedApp` (request counter, latency histogram, access line) with the access log `off`,
`text` and `json` (lines go to /dev/null, as to a log file). The proxy case wraps a 4-chunk SSE
answer as `Proxy.__call__` does instead: one `CallWatch` around its `send` (status, time to first
token scan), then the per-front-end families, the HTTP families and the access line. Prints
microseconds per request (median of 5 rounds) and the overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.stderr = open(os.devnull, "w")  # access lines are written, to nowhere

from fastapi import FastAPI, Response  # noqa: E402

from services.common.accesslog import AccessLog  # noqa: E402
from services.common.metrics import HttpObserver, ObservedApp  # noqa: E402
from services.gateway.metrics import CallWatch  # noqa: E402
from services.gateway.proxy.handler import ROUTES  # noqa: E402

PROXY_PATH = "/proxy/rollout/ro-1/attempt/a-1/mode/train/openai/v1/chat/completions"
CHAT = ROUTES[("openai", "POST", "chat/completions")][1]
CHUNKS = [b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'] + [
    b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
] * 3


def fastapi_app() -> Any:
    app = FastAPI()

    @app.get("/api/rollouts/{rollout_id}")
    async def get(rollout_id: str) -> Response:
        return Response(b'{"rollout_id": "x"}', media_type="application/json")

    return app


async def proxy_like(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for chunk in CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def per_request_us(app: Any, path: str, method: str, requests: int) -> float:
    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b"", "root_path": ""}
    scope |= {"http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    for _ in range(200):  # warm up (FastAPI builds its middleware stack on the first call)
        await app(dict(scope), receive, send)
    began = time.perf_counter()
    for _ in range(requests):
        await app(dict(scope), receive, send)
    return (time.perf_counter() - began) / requests * 1e6


def measure(make: Callable[[], Any], path: str, method: str, requests: int) -> float:
    return statistics.median(asyncio.run(per_request_us(make(), path, method, requests)) for _ in range(5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    n = parser.parse_args().requests
    rows: list[tuple[str, float, float]] = []
    base = measure(fastapi_app, "/api/rollouts/ro-1", "GET", n)
    for fmt in ("off", "text", "json"):

        def observed_fastapi(f: str = fmt) -> Any:
            return ObservedApp(fastapi_app(), "bench", access_log=AccessLog("bench", f))

        wrapped = measure(observed_fastapi, "/api/rollouts/ro-1", "GET", n)
        rows.append((f"FastAPI GET, access log {fmt}", base, wrapped))
    base = measure(lambda: proxy_like, PROXY_PATH, "POST", n)
    for fmt in ("off", "text", "json"):

        def observed_proxy(f: str = fmt) -> Any:
            http = HttpObserver("bench", AccessLog("bench", f))

            async def edge(scope: dict[str, Any], receive: Any, send: Any) -> None:
                watch = CallWatch(send)
                try:
                    await proxy_like(scope, receive, watch.send)
                finally:
                    watch.answered(scope, http, CHAT)

            return edge

        wrapped = measure(observed_proxy, PROXY_PATH, "POST", n)
        rows.append((f"proxy-like SSE, access log {fmt}", base, wrapped))
    print(f"{'case':38} {'plain us/req':>13} {'observed':>10} {'overhead':>10}")
    for name, plain, observed in rows:
        print(f"{name:38} {plain:13.1f} {observed:10.1f} {observed - plain:+9.1f}us")


if __name__ == "__main__":
    main()
