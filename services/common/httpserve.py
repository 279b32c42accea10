"""A tiny HTTP endpoint for `/metrics` and `/healthz`, on asyncio alone, for services with no other HTTP.

    server = await serve("controller", "127.0.0.1", 18091, health=lambda: (200, b'{"status": "ok"}'))

The controller has no HTTP API of its own, so a web framework would be all weight and no use
there. Each request is answered and the connection closed; every request gets an
access line and is counted in `rollwire_http_requests_total` like the ASGI services' requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from services.common.metrics import CONTENT_TYPE, METRICS_PATH, HttpObserver, exposition

Health = Callable[[], tuple[int, bytes]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
HEALTH_PATHS = ("/healthz", "/health")


def encode_response(code: int, body: bytes, content_type: str) -> bytes:
    """A complete HTTP/1.1 response that closes the connection."""
    head = (
        f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def respond(method: str, path: str, health: Health) -> tuple[int, bytes, str]:
    """(status, body, content type) for a request line's method and path."""
    path = path.split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return 405, b'{"error": "only GET"}', "application/json"
    if path == METRICS_PATH:
        return 200, exposition(), CONTENT_TYPE
    if path in HEALTH_PATHS:
        code, body = health()
        return code, body, "application/json"
    return 404, b'{"error": "unknown path: try /metrics or /healthz"}', "application/json"


def observe(observer: HttpObserver, method: str, path: str, status: int, began: float) -> None:
    """Count, time and log one answered request (its route: the path served, else `unmatched`)."""
    bare = path.split("?", 1)[0]
    route = bare if bare == METRICS_PATH or bare in HEALTH_PATHS else "unmatched"
    observer.observe(method, bare, route, status, time.perf_counter() - began)


async def serve(service: str, host: str, port: int, health: Health) -> asyncio.Server:
    """Start serving on host:port (port 0 picks a free one; see `server.sockets`)."""
    observer = HttpObserver(service)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        began = time.perf_counter()
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            method, path, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            code, body, content_type = respond(method, path, health)
            writer.write(encode_response(code, b"" if method == "HEAD" else body, content_type))
            await writer.drain()
            observe(observer, method, path, code, began)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port)
