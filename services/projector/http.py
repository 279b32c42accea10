"""A tiny HTTP endpoint for `/metrics` (Prometheus) and `/healthz` (JSON), on asyncio alone.

The projector has no other HTTP surface, so a web framework would be all weight and no use.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from services.projector.status import Status

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


def _response(code: int, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def route(status: Status, method: str, path: str) -> bytes:
    """The full HTTP response for a request line."""
    path = path.split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response(405, b'{"error": "only GET"}', "application/json")
    if path == "/metrics":
        return _response(200, status.prometheus().encode(), "text/plain; version=0.0.4")
    if path in ("/healthz", "/health"):
        health = status.health()
        return _response(200 if health.status == "ok" else 503, msgspec.json.encode(health), "application/json")
    return _response(404, b'{"error": "unknown path: try /metrics or /healthz"}', "application/json")


async def serve(status: Status, host: str, port: int) -> asyncio.Server:
    """Start serving on host:port (port 0 picks a free one; see `server.sockets`)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            method, path, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            writer.write(route(status, method, path))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port)
