"""The projector's `/metrics` (Prometheus) and `/healthz` (JSON), on the shared tiny endpoint.

The projector has no other HTTP surface; `services.common.httpserve` answers, counts and logs
each request, `services.projector.metrics` turns the projector's `Status` into metric families.
"""

from __future__ import annotations

import asyncio

import msgspec

from services.common import httpserve
from services.projector import metrics
from services.projector.status import Status


def health(status: Status) -> tuple[int, bytes]:
    """The `/healthz` answer: 200 with the report when ok, 503 when degraded."""
    report = status.health()
    return 200 if report.status == "ok" else 503, msgspec.json.encode(report)


def route(status: Status, method: str, path: str) -> bytes:
    """The full HTTP response for a request line."""
    metrics.watch(status)
    code, body, content_type = httpserve.respond(method, path, lambda: health(status))
    return httpserve.encode_response(code, body, content_type)


async def serve(status: Status, host: str, port: int) -> asyncio.Server:
    """Start serving on host:port (port 0 picks a free one; see `server.sockets`)."""
    metrics.watch(status)
    return await httpserve.serve("projector", host, port, lambda: health(status))
