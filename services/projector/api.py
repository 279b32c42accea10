"""The projector's HTTP surface: its query API, run summaries, the viewer, `/metrics` and `/healthz`.

    app = create_query_app(PostgresRolloutReader(database_url), status=projector.status, admin_token=token)

The projector owns the read side; this app is how anyone else reads it (the gateway forwards
every `GET /api/...` here, so users keep one URL):

- `GET /query/...`: the `RolloutReader` queries (`services.common.readside`) as JSON: one rollout,
  a filtered page, terminal rollouts, a rollout's events, a run. `ProjectorReader` is their client.
- `GET /api/runs`: every run with its summary; `GET /api/runs/{run_id}/summary`: one run's.
- `min_seq` on any GET under `/query/`, `/api/` or `/ui/api/`: the request waits until the
  projection has applied that stream sequence (every write answers with its `seq`), up to
  `min_seq_timeout_s`; past it the answer is 503 with the applied sequence (read-your-writes).
- Postgres unreachable: 503 with a body that says so (writes go to the stream and still work).
- The trajectory viewer under `/ui`; `/metrics` (Prometheus) and `/healthz`.

With an `admin_token`, everything but the viewer's page, `/metrics` and `/healthz` needs
`Authorization: Bearer <admin token>`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import msgspec
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas import InvalidId
from schemas.bounds import JSON_INT_MAX
from services.common.metrics import CONTENT_TYPE, ObservedApp, exposition
from services.common.readside import RolloutQuery
from services.projector import metrics
from services.projector.openapi import openapi_document
from services.projector.reader import PostgresRolloutReader, ProjectionBehind, ReadModelUnavailable
from services.projector.status import Status
from services.projector.viewer import bearer_check, mount_viewer
from services.projector.viewer.app import Authorize, ViewerAuthError, int_param

RETRY_AFTER_S = 2
_json = msgspec.json.Encoder()
Fetch = Callable[[Request], Awaitable[Any]]


def _error(status: int, message: str, **extra: Any) -> Response:
    return Response(
        _json.encode({"error": message, **extra}),
        status_code=status,
        media_type="application/json",
        headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None,
    )


class MinSeqMiddleware:
    """ASGI middleware: a GET with `?min_seq=N` waits until the projection has applied seq N.

    The caller is authorised first (every path it waits on needs the admin token when there is
    one): a caller without it is answered 401 at once, not after the wait.
    """

    def __init__(
        self,
        app: Any,
        reader: PostgresRolloutReader,
        timeout_s: float,
        prefixes: tuple[str, ...],
        authorize: Authorize | None = None,
    ) -> None:
        self.app = app
        self.reader = reader
        self.timeout_s = timeout_s
        self.prefixes = prefixes
        self.authorize = authorize

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"].startswith(self.prefixes):
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            raw = query.get("min_seq")  # `min_seq=` (blank) is a mistake to name, not an absent parameter
            if raw:
                try:
                    if self.authorize is not None:
                        self.authorize(Request(scope))
                except ViewerAuthError as exc:
                    await _error(401, str(exc))(scope, receive, send)
                    return
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


def _route(authorize: Authorize | None, fetch: Fetch, missing: str) -> Callable[[Request], Awaitable[Response]]:
    """A GET handler: authorize, fetch, answer JSON (404 naming `missing` when the fetch finds nothing)."""

    async def handle(request: Request) -> Response:
        if authorize is not None:
            authorize(request)
        data = await fetch(request)
        if isinstance(data, Response):  # a refusal the fetch made itself
            return data
        if data is None:
            return _error(404, missing.format(**request.path_params))
        return Response(_json.encode(data), media_type="application/json")

    return handle


def _query_routes(reader: PostgresRolloutReader) -> list[tuple[str, Fetch, str]]:
    """The `RolloutReader` queries and the run summaries as (path, fetch, what a 404 says)."""

    async def rollout(request: Request) -> Any:
        return await reader.get(request.path_params["rollout_id"], request.query_params.get("run_id"))

    async def rollouts(request: Request) -> Any:
        params = request.query_params
        query = RolloutQuery(
            run_id=params.get("run_id"),
            statuses=frozenset(params.getlist("status")),
            group_id=params.get("group_id"),
            mode=params.get("mode"),
            limit=int_param(request, "limit", 500, 1),
            cursor=int_param(request, "cursor", 0),
        )
        return await reader.query(query)

    async def terminal(request: Request) -> Any:
        views, total = await reader.terminal(int_param(request, "after", 0), int_param(request, "limit", 1000, 1))
        return {"views": views, "total": total}

    async def events(request: Request) -> Any:
        return await reader.events(request.path_params["rollout_id"], request.query_params.get("run_id", "*"))

    async def run(request: Request) -> Any:
        return await reader.run(request.path_params["run_id"])

    async def position(request: Request) -> Any:
        return {"applied_seq": await reader.applied_seq()}

    async def run_list(request: Request) -> Any:
        """`GET /api/runs?limit=`: every run's summary, from the projection."""
        summaries = await reader.summaries(int_param(request, "limit", 200, 1))
        return {"runs": msgspec.to_builtins(summaries), "applied_seq": await reader.applied_seq()}

    async def run_summary(request: Request) -> Any:
        """`GET /api/runs/{run_id}/summary`: rollouts by status, reward mean, tokens, calls per rollout."""
        return await reader.summary(request.path_params["run_id"])

    return [
        ("/query/position", position, "nothing"),
        ("/query/rollouts", rollouts, "nothing"),
        ("/query/terminal", terminal, "nothing"),
        ("/query/rollouts/{rollout_id}", rollout, "rollout {rollout_id} does not exist"),
        ("/query/rollouts/{rollout_id}/events", events, "rollout {rollout_id} does not exist"),
        ("/query/runs/{run_id}", run, "run {run_id} was never started (POST /api/runs)"),
        ("/api/runs", run_list, "nothing"),
        ("/api/runs/{run_id}/summary", run_summary, "run {run_id} has no events"),
    ]


def create_query_app(
    reader: PostgresRolloutReader,
    *,
    status: Status | None = None,
    admin_token: str | None = None,
    min_seq_timeout_s: float = 10.0,
    viewer: bool = True,
) -> FastAPI:
    """The projector's HTTP app over `reader` (see the module docstring)."""
    app = FastAPI(title="Rollwire projector", openapi_url=None, docs_url=None, redoc_url=None)
    authorize = bearer_check(admin_token) if admin_token else None
    _add_error_handlers(app)
    app.add_middleware(
        MinSeqMiddleware,
        reader=reader,
        timeout_s=min_seq_timeout_s,
        prefixes=("/query/", "/api/", "/ui/api/"),
        authorize=authorize,
    )
    # Outermost: every request is counted and logged, min_seq waits included.
    app.add_middleware(ObservedApp, service="projector")
    for path, fetch, missing in _query_routes(reader):
        app.add_api_route(path, _route(authorize, fetch, missing), methods=["GET"], include_in_schema=False)
    if status is not None:
        _add_status(app, status)
    if viewer:
        mount_viewer(app, reader, authorize=authorize)
    _add_openapi(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as a JSON error body: 401, 503 (the read model down or behind `min_seq`), 422, and HTTP errors."""

    async def unauthorized(request: Request, exc: Exception) -> Response:
        return _error(401, str(exc))

    async def unavailable(request: Request, exc: Exception) -> Response:
        return _error(503, str(exc))

    async def behind(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProjectionBehind)
        return _error(503, str(exc), applied_seq=exc.applied, min_seq=exc.wanted)

    async def invalid(request: Request, exc: Exception) -> Response:
        return _error(422, str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:  # a 404 of the static page too
        assert isinstance(exc, StarletteHTTPException)
        response = _error(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ViewerAuthError, unauthorized)
    app.add_exception_handler(ReadModelUnavailable, unavailable)
    app.add_exception_handler(ProjectionBehind, behind)
    app.add_exception_handler(InvalidId, invalid)
    app.add_exception_handler(ValueError, invalid)


def _add_openapi(app: FastAPI) -> None:
    """`GET /openapi.json`, built on its first request (every route is added by then)."""
    document: list[bytes] = []

    async def openapi_json(request: Request) -> Response:
        """`GET /openapi.json`: the projector's routes (no token: the document holds no data)."""
        if not document:
            document.append(_json.encode(openapi_document(request.app)))
        return Response(document[0], media_type="application/json")

    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)


def _add_status(app: FastAPI, status: Status) -> None:
    metrics.watch(status)

    async def prometheus(request: Request) -> Response:
        """`GET /metrics`: the projector's position and lag, for Prometheus (ObservedApp answers it first)."""
        return Response(exposition(), media_type=CONTENT_TYPE)

    async def healthz(request: Request) -> Response:
        """`GET /healthz`: 200 while projecting, 503 when not (the body says why)."""
        health = status.health()
        return Response(
            _json.encode(health), status_code=200 if health.status == "ok" else 503, media_type="application/json"
        )

    app.add_api_route("/metrics", prometheus, methods=["GET"], include_in_schema=False)
    app.add_api_route("/healthz", healthz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", healthz, methods=["GET"], include_in_schema=False)
