"""Prometheus metrics shared by every service: the registry, the HTTP families, the ASGI middleware.

Every service exports on the process's default `prometheus_client` registry (so the process
collector's `process_cpu_seconds_total`, `process_resident_memory_bytes` come along), served at
`GET /metrics` in Prometheus' text format. `ObservedApp` wraps an ASGI app once and gives it:

- `rollwire_http_requests_total{service, method, route, status}` and
  `rollwire_http_request_duration_seconds{service, method, route}` (a histogram);
- `GET /metrics`, answered before the app sees the request;
- one access line per request (`services.common.accesslog`).

`route` is the route's template (`/api/rollouts/{rollout_id}`), never the raw path, so ids never
become label values: unmatched paths are `unmatched`. A handler the router does not see (the
gateway's proxy) records its requests, with its own route templates, through an `HttpObserver`,
as the middleware does. Label sets stay bounded by the routes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.registry import Collector

from services.common.accesslog import AccessLog

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

METRICS_PATH = "/metrics"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds: from a 1 ms health check to a 10-minute model call.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    600.0,
)

HTTP_REQUESTS = Counter(
    "rollwire_http_requests",
    "HTTP requests answered, by service, method, route template and status code.",
    ["service", "method", "route", "status"],
)
HTTP_DURATION = Histogram(
    "rollwire_http_request_duration_seconds",
    "Time from a request's arrival to the end of its response (a stream: to its last byte).",
    ["service", "method", "route"],
    buckets=LATENCY_BUCKETS,
)


_installed: set[int] = set()


def install(*collectors: Collector) -> None:
    """Register a service's families on the process registry, once, when the service starts.

    Services define their families unregistered (`registry=None`), so a process that merely
    imports another service's module (a shared read model, a test) does not export its families.
    """
    for collector in collectors:
        if id(collector) not in _installed:
            REGISTRY.register(collector)
            _installed.add(id(collector))


def exposition(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The registry's metrics in Prometheus' text format."""
    return generate_latest(registry)


def route_template(scope: Scope) -> str:
    """The matched route's path template (Starlette sets `scope["route"]`), else `unmatched`."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class HttpObserver:
    """Counts and times one service's requests on the HTTP families and writes their access lines."""

    def __init__(self, service: str, access_log: AccessLog | None = None) -> None:
        self.service = service
        self.access = access_log if access_log is not None else AccessLog(service)
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}  # label lookups, made once

    def observe(self, method: str, path: str, route: str, status: int, elapsed: float) -> None:
        """Record one answered request (`route`: its route template, the label for its path)."""
        label = method if method in _METHODS else "other"
        key = (label, route, str(status))
        children = self._children.get(key)
        if children is None:
            children = (HTTP_REQUESTS.labels(self.service, *key), HTTP_DURATION.labels(self.service, label, route))
            self._children[key] = children
        children[0].inc()
        children[1].observe(elapsed)
        self.access.write(method, path, status, elapsed)


class ObservedApp:
    """ASGI middleware: HTTP metrics, `/metrics` and access logs for one service (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        service: str,
        *,
        access_log: AccessLog | None = None,
    ) -> None:
        self.app = app
        self.observer = HttpObserver(service, access_log)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        method, path = scope["method"], scope["path"]
        status = 500  # what the client gets when the app raises before answering

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if path == METRICS_PATH and method in ("GET", "HEAD"):
                await _send_metrics(observed_send, method)
            elif path == METRICS_PATH:
                await _refuse_method(observed_send)
            else:
                await self.app(scope, receive, observed_send)
        finally:
            elapsed = time.perf_counter() - began
            route = METRICS_PATH if path == METRICS_PATH else route_template(scope)
            self.observer.observe(method, path, route, status, elapsed)


_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))


async def _refuse_method(send: Send) -> None:
    body = b'{"error": "/metrics answers GET and HEAD only"}'
    headers = [(b"content-type", b"application/json"), (b"allow", b"GET, HEAD")]
    await send({"type": "http.response.start", "status": 405, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_metrics(send: Send, method: str) -> None:
    body = exposition()
    headers = [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
