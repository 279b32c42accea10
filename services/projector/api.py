"""The read side the gateway serves from Postgres: run summaries, `min_seq` waits, 503s, the viewer.

    reader = PostgresRolloutReader(database_url)
    app = create_app(settings, reader=reader)          # the gateway's GET endpoints read Postgres
    install_read_side(app, reader, authorize=admin)    # plus what this module adds

What it adds to the app:

- `GET /api/runs`: every run with its summary (rollouts by status, reward mean, tokens, calls per
  rollout, ...); `GET /api/runs/{run_id}/summary`: one run's.
- `min_seq` on any GET under `/api/` or `/ui/api/`: the request waits until the projection has
  applied that stream sequence (every write answers with its `seq`), up to `min_seq_timeout_s`;
  past it the answer is 503 with the applied sequence, so a client can read its own writes.
- Postgres unreachable: 503 with a body that says so (writes go to the stream and still work).
- The trajectory viewer under `/ui`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import msgspec
from fastapi import FastAPI, Request, Response

from schemas.bounds import JSON_INT_MAX
from services.projector.reader import PostgresRolloutReader, ProjectionBehind, ReadModelUnavailable
from services.projector.viewer import mount_viewer

RETRY_AFTER_S = 2
_json = msgspec.json.Encoder()
Authorize = Callable[[Request], object]


def _error(status: int, message: str, **extra: Any) -> Response:
    return Response(
        _json.encode({"error": message, **extra}),
        status_code=status,
        media_type="application/json",
        headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None,
    )


class MinSeqMiddleware:
    """ASGI middleware: a GET with `?min_seq=N` waits until the projection has applied seq N."""

    def __init__(self, app: Any, reader: PostgresRolloutReader, timeout_s: float, prefixes: tuple[str, ...]) -> None:
        self.app = app
        self.reader = reader
        self.timeout_s = timeout_s
        self.prefixes = prefixes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"].startswith(self.prefixes):
            raw = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("min_seq")
            if raw:
                response = await self._wait(raw[-1])
                if response is not None:
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _wait(self, raw: str) -> Response | None:
        try:
            wanted = int(raw)
        except ValueError:
            return _error(422, f"query parameter min_seq={raw!r} is not an integer", field="min_seq")
        if not 0 <= wanted <= JSON_INT_MAX:  # a stream sequence: what a bigint and every JSON reader hold
            return _error(422, f"query parameter min_seq must be between 0 and {JSON_INT_MAX}", field="min_seq")
        try:
            await self.reader.wait_for(wanted, self.timeout_s)
        except ProjectionBehind as behind:
            return _error(503, str(behind), applied_seq=behind.applied, min_seq=behind.wanted)
        except ReadModelUnavailable as exc:
            return _error(503, str(exc))
        return None


def _guarded(
    authorize: Authorize | None, fetch: Callable[[Request], Awaitable[Any]]
) -> Callable[[Request], Awaitable[Response]]:
    @functools.wraps(fetch)
    async def handle(request: Request) -> Response:
        if authorize is not None:
            maybe = authorize(request)
            if isinstance(maybe, Awaitable):
                await maybe
        data = await fetch(request)
        if isinstance(data, Response):  # a refusal the fetch made itself
            return data
        if data is None:
            return _error(404, f"run {request.path_params.get('run_id')} has no events")
        return Response(_json.encode(data), media_type="application/json")

    return handle


def install_read_side(
    app: FastAPI,
    reader: PostgresRolloutReader,
    *,
    authorize: Authorize | None = None,
    min_seq_timeout_s: float = 10.0,
    viewer: bool = True,
) -> None:
    """Add run summaries, `min_seq` waits, the Postgres 503s and (with `viewer`) `/ui` to `app`.

    Call before the app serves its first request. `authorize` guards the data (the gateway passes
    its admin check); it may raise the app's own error types.
    """

    async def unavailable(request: Request, exc: Exception) -> Response:
        return _error(503, str(exc))

    async def behind(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProjectionBehind)
        return _error(503, str(exc), applied_seq=exc.applied, min_seq=exc.wanted)

    app.state.read_side = True  # the OpenAPI document then lists `min_seq` on every GET
    app.add_exception_handler(ReadModelUnavailable, unavailable)
    app.add_exception_handler(ProjectionBehind, behind)
    app.add_middleware(MinSeqMiddleware, reader=reader, timeout_s=min_seq_timeout_s, prefixes=("/api/", "/ui/api/"))

    async def run_list(request: Request) -> Any:
        """`GET /api/runs?limit=` (admin): every run's summary, from the projection."""
        limit = request.query_params.get("limit", "200")
        if not limit.isdigit() or not 1 <= int(limit) <= JSON_INT_MAX:
            return _error(422, f"query parameter limit={limit!r} is not an integer in 1..{JSON_INT_MAX}", field="limit")
        summaries = await reader.summaries(int(limit))
        return {"runs": msgspec.to_builtins(summaries), "applied_seq": await reader.applied_seq()}

    async def run_summary(request: Request) -> Any:
        """`GET /api/runs/{run_id}/summary` (admin): rollouts by status, reward mean, tokens, calls per rollout."""
        summary = await reader.summary(request.path_params["run_id"])
        return None if summary is None else msgspec.to_builtins(summary)

    app.add_api_route("/api/runs", _guarded(authorize, run_list), methods=["GET"], include_in_schema=False)
    app.add_api_route(
        "/api/runs/{run_id}/summary", _guarded(authorize, run_summary), methods=["GET"], include_in_schema=False
    )
    if viewer:
        mount_viewer(app, reader, authorize=authorize)
