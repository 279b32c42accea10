"""The gateway application: rollout API, proxy and phase gate on one event store.

    app = create_app(settings_from_env())   # connects to NATS when the app starts (lifespan)

The proxy is a plain ASGI handler placed in front of the FastAPI routes (`/proxy/...` never
goes through routing or validation); everything else is ordinary FastAPI routes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from schemas import PhaseChanged
from services.common.eventstore import EventStore, StoredEvent
from services.common.metrics import HttpObserver, ObservedApp
from services.common.readside import ProjectorReader, RolloutReader, StreamRolloutReader
from services.gateway import metrics
from services.gateway.api import bodies, reads, routes
from services.gateway.api.commands import checked_id, event_id_for, keyed
from services.gateway.auth import Authenticator, TokenSigner
from services.gateway.context import Gateway
from services.gateway.errors import CLIENT_ERRORS, ApiError, internal, retry_headers, translate, unavailable
from services.gateway.http import decode, encode, read_body
from services.gateway.idempotency import IdempotencyCache
from services.gateway.openapi import openapi_document
from services.gateway.phase import PhaseGate
from services.gateway.phasesync import PhaseSync
from services.gateway.proxy.budgets import Budgets
from services.gateway.proxy.frontends.base import error_body
from services.gateway.proxy.handler import FRONT_ENDS, PREFIX, Proxy, misdirected
from services.gateway.proxy.payload import announce
from services.gateway.proxy.reaper import CallReaper
from services.gateway.proxy.recording import CallChains
from services.gateway.proxy.upstream import UpstreamClient
from services.gateway.settings import GatewaySettings
from services.gateway.state import GatewayState


class _StoreDown:
    """ASGI middleware: `/api/...` answers 503 at once while the event store (NATS) is unreachable."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path.startswith("/api/") and not scope["app"].state.gateway.store.nc.is_connected:
                error = unavailable("the event store (NATS) is unavailable; retry later")
                await send(
                    {
                        "type": "http.response.start",
                        "status": error.status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            *((k.lower().encode(), v.encode()) for k, v in error.headers.items()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": error.body()})
                return
        await self.app(scope, receive, send)


class _GatewayApp(FastAPI):
    """FastAPI with `/proxy/...` answered before Starlette's middleware stack (its error, telemetry and
    body-limit layers cost every model call and serve none: the proxy answers its own errors, bounds
    its own bodies, and counts, times and access-logs its own calls)."""

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            await self.state.proxy(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _reader(settings: GatewaySettings, store: EventStore) -> RolloutReader:
    """Where reads are answered: the projector's query API, else a fold of the stream."""
    if settings.projector_url:
        return ProjectorReader(settings.projector_url, token=settings.admin_token)
    return StreamRolloutReader(store)


def _lifespan(settings: GatewaySettings) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Connect at start (event store, caches, phase gate and sync, reaper, upstream client, reader), close at stop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await EventStore.connect(
            settings.nats_url, stream=settings.stream, name="rollwire-gateway", reconnect_buffer=False
        )
        state = GatewayState(store, cache_bytes=settings.cache_bytes)
        gate = PhaseGate(settings.phase_hold_timeout_s)
        state.on_event(lambda stored: _follow_phase(gate, stored))
        upstream = UpstreamClient(
            read_timeout_s=settings.upstream_timeout_s, connect_timeout_s=settings.upstream_connect_timeout_s
        )
        reader = _reader(settings, store)
        gateway = Gateway(
            settings=settings,
            store=store,
            state=state,
            reader=reader,
            auth=Authenticator(settings.admin_token, TokenSigner(settings.secret)),
            idempotency=IdempotencyCache(settings.idempotency_cache_bytes),
            gate=gate,
            upstream=upstream,
            budgets=Budgets(store, settings.budget_cache_bytes),
            chains=CallChains(settings.chain_cache_bytes, compact=settings.record_format == "compact"),
            reaper=CallReaper(store, interval_s=settings.reaper_interval_s),
        )
        announce(store.max_payload)
        await state.start()
        assert gateway.reaper is not None
        await gateway.reaper.start()
        gateway.phases = PhaseSync(store, gate, gateway.reaper.instance, gateway.reaper.alive)
        await gateway.phases.start(settings.drain_timeout_s)
        await gateway.idempotency.share(store.js)
        await gateway.budgets.open()
        app.state.gateway = gateway
        app.state.proxy = Proxy(gateway, HttpObserver("gateway"))
        metrics.export(FRONT_ENDS, gateway.idempotency.__len__, lambda: gateway.idempotency.bytes)
        try:
            yield
        finally:
            await gateway.phases.stop()
            if store.nc.is_connected:
                await gateway.budgets.close()  # what this gateway holds ahead goes back to the attempts
            await gateway.reaper.stop()
            await state.stop()
            await upstream.close()
            if isinstance(reader, ProjectorReader):
                await reader.close()
            if store.nc.is_connected:
                await store.close()
            else:
                await store.nc.close()

    return lifespan


async def _errors(request: Request, exc: Exception) -> Response:
    error = translate(exc)
    if error is None:
        error = internal(exc)
    return Response(error.body(), status_code=error.status, media_type="application/json", headers=error.headers)


async def _http_errors(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    headers = retry_headers(exc.status_code) | dict(getattr(exc, "headers", None) or {})
    meant = misdirected(request.url.path, request.headers.get("anthropic-version"), _base_url(request))
    if exc.status_code == 404 and meant is not None:  # an SDK given the gateway's URL as its base URL
        api, message = meant
        return Response(error_body(api, 404, message), status_code=404, media_type="application/json", headers=headers)
    if exc.status_code == 405:  # every method this path serves, not only the first route's
        headers["Allow"] = ", ".join(_allowed(request.app, request.scope))
    return Response(
        encode({"error": str(exc.detail)}),
        status_code=exc.status_code,
        media_type="application/json",
        headers=headers or None,
    )


def _base_url(request: Request) -> str:
    gateway = getattr(request.app.state, "gateway", None)
    return gateway.settings.base_url if gateway is not None else str(request.base_url).rstrip("/")


async def _validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    field = ".".join(str(p) for p in first.get("loc", ()))
    return Response(
        encode({"error": f"{field}: {first.get('msg', 'invalid')}", "field": field}),
        status_code=422,
        media_type="application/json",
        headers=retry_headers(422),
    )


def create_app(settings: GatewaySettings) -> FastAPI:
    """The gateway as a FastAPI app; reads go to the projector at `settings.projector_url` when set."""
    app = _GatewayApp(
        title="Rollwire gateway",
        version="1.0",
        lifespan=_lifespan(settings),
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(_StoreDown)
    app.add_middleware(ObservedApp, service="gateway")
    app.state.read_side = bool(settings.projector_url)  # the OpenAPI document then lists `min_seq` on every GET
    # Handled by type (not only as `Exception`, whose handler Starlette runs and then re-raises
    # into the server's log): a client's error is an answer, not a traceback.
    handled: tuple[type[Exception], ...] = (Exception, *CLIENT_ERRORS)
    for exc_type in handled:
        app.add_exception_handler(exc_type, _errors)
    app.add_exception_handler(StarletteHTTPException, _http_errors)
    app.add_exception_handler(RequestValidationError, _validation)
    routes.register(app)
    reads.register(app)
    app.add_api_route("/api/phase", set_phase, methods=["POST"])

    document: list[bytes] = []  # built on first request (all routes are added by then), then served as is

    async def openapi_json(request: Request) -> Response:
        """`GET /openapi.json`: this gateway's API (bodies as JSON Schema), built from its routes."""
        if not document:
            document.append(encode(openapi_document(request.app, routes.BODIES | {set_phase: bodies.PhaseBody})))
        return Response(document[0], media_type="application/json")

    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)
    return app


def _allowed(app: FastAPI, scope: Any) -> list[str]:
    """The methods the routes matching this request's path serve."""
    matched = next((r for r in app.routes if r.matches({**scope, "method": "GET"})[0] != Match.NONE), None)
    path = getattr(matched, "path", None)
    methods: set[str] = set()
    for route in app.routes:
        if path is not None and getattr(route, "path", None) == path:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def _follow_phase(gate: PhaseGate, stored: StoredEvent) -> None:
    """Phase events written by anyone (or replayed at start) open or close the run's gate."""
    event = stored.event
    if isinstance(event, PhaseChanged):
        if event.phase == "update":
            gate.close(event.run_id)
        else:
            gate.release(event.run_id)


async def _drain_everywhere(gw: Gateway, run_id: str) -> set[str]:
    """Close the run's gate on every gateway replica and wait for their calls; the ones still busy."""
    timeout = gw.settings.drain_timeout_s
    if gw.phases is not None:
        return await gw.phases.close_all(run_id, timeout)
    return set() if await gw.gate.drain(run_id, timeout) else {"this gateway"}


async def set_phase(request: Request) -> Response:
    """`POST /api/phase` (admin): `update` holds new calls and drains in-flight ones; `rollout` releases."""
    gw: Gateway = request.app.state.gateway
    gw.admin(request)
    body = await read_body(request, gw.settings.max_body_bytes)
    phase = decode(body, bodies.PhaseBody)
    run_id = checked_id("run_id", phase.run_id or gw.settings.default_run)

    async def command(key: str | None) -> tuple[int, bytes]:
        previous = gw.state.phase(run_id)
        version = (
            phase.weights_version
            if phase.weights_version is not None
            else (previous.weights_version if previous else None)
        )
        event = PhaseChanged(
            event_id=event_id_for(key, "phase", run_id), run_id=run_id, phase=phase.phase, weights_version=version
        )
        if phase.phase == "update":
            gw.gate.close(run_id)
            busy = await _drain_everywhere(gw, run_id)
            if busy:
                raise ApiError(
                    504,
                    f"calls of run {run_id} were still in flight after "
                    f"{gw.settings.drain_timeout_s:g}s; new calls stay held",
                    in_flight=gw.gate.in_flight(run_id),
                    gateways=sorted(busy),
                )
            try:
                ack = await gw.append_registry(event)
            except Exception:
                gw.gate.release(run_id)
                if gw.phases is not None:
                    await gw.phases.open_all(run_id)
                raise
        else:
            ack = await gw.append_registry(event)
            gw.gate.release(run_id)
            if gw.phases is not None:
                await gw.phases.open_all(run_id)
        return 200, encode(
            {
                "run_id": run_id,
                "phase": phase.phase,
                "weights_version": version,
                "seq": ack.seq,
                "in_flight": gw.gate.in_flight(run_id),
            }
        )

    return await keyed(request, "admin", body, command)
