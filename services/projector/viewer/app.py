"""Mounting the viewer on a FastAPI app: its JSON routes, then its static files."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from schemas.bounds import JSON_INT_MAX, PAGE_MAX
from services.common.query import int_query
from services.projector.reader import PostgresRolloutReader, ReadModelUnavailable
from services.projector.viewer import queries

STATIC = Path(__file__).parent / "static"
Authorize = Callable[[Request], object]
_json = msgspec.json.Encoder()


class ViewerAuthError(PermissionError):
    """The request lacks the admin token the viewer's data needs."""


def bearer_check(token: str) -> Authorize:
    """An `authorize` that accepts `Authorization: Bearer <token>` (for running the viewer alone)."""

    def check(request: Request) -> None:
        sent = request.headers.get("authorization", "")
        if not (sent.startswith("Bearer ") and hmac.compare_digest(sent[7:].strip(), token)):
            raise ViewerAuthError("the viewer needs the admin token: send `Authorization: Bearer <token>`")

    return check


def _respond(status: int, body: Any) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def int_param(request: Request, name: str, default: int, low: int = 0, high: int = PAGE_MAX) -> int:
    """An integer query parameter in [low, high] (`default` when absent); `ViewerQueryError` (422) otherwise."""
    try:
        return int_query(request.query_params.get(name), name, default, low, high)
    except ValueError as exc:
        raise queries.ViewerQueryError(str(exc)) from None


def _handler(
    authorize: Authorize | None, fetch: Callable[[Request], Awaitable[Any]]
) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        try:
            if authorize is not None:
                maybe = authorize(request)
                if isinstance(maybe, Awaitable):
                    await maybe
            data = await fetch(request)
        except ViewerAuthError as exc:
            return _respond(401, {"error": str(exc)})
        except ReadModelUnavailable as exc:
            return _respond(503, {"error": str(exc)})
        except queries.ViewerQueryError as exc:
            return _respond(422, {"error": str(exc)})
        if data is None:
            return _respond(404, {"error": f"nothing at {request.url.path}"})
        return _respond(200, data)

    return handle


def mount_viewer(
    app: FastAPI, reader: PostgresRolloutReader, *, authorize: Authorize | None = None, prefix: str = "/ui"
) -> None:
    """Serve the viewer page at `prefix/` and its data at `prefix/api/...` (guarded by `authorize`)."""

    async def run_list(request: Request) -> Any:
        return await queries.runs(reader)

    async def run_rollouts(request: Request) -> Any:
        params = request.query_params
        return await queries.rollouts(
            reader,
            request.path_params["run_id"],
            sort=params.get("sort", "created"),
            desc=params.get("desc") in ("1", "true"),
            status=params.get("status") or None,
            flagged=params.get("flagged") in ("1", "true"),
            search=params.get("q") or None,
            limit=int_param(request, "limit", 200, 1, 1000),
            offset=int_param(request, "offset", 0),
        )

    async def one_rollout(request: Request) -> Any:
        return await queries.rollout(reader, request.path_params["run_id"], request.path_params["rollout_id"])

    async def rollout_timeline(request: Request) -> Any:
        return await queries.timeline(
            reader,
            request.path_params["run_id"],
            request.path_params["rollout_id"],
            after_seq=int_param(request, "after_seq", 0),
            limit=int_param(request, "limit", 2000, 1, 10_000),
        )

    async def one_call(request: Request) -> Any:
        seq = int_param(request, "seq", 0, high=JSON_INT_MAX) or int(request.path_params["seq"])
        if seq > JSON_INT_MAX:  # no stream sequence is this large (and Postgres' bigint stops at 2^63)
            return None
        return await queries.call(reader, seq)

    api = f"{prefix}/api"
    routes: list[tuple[str, Callable[[Request], Awaitable[Any]]]] = [
        ("/runs", run_list),
        ("/runs/{run_id}/rollouts", run_rollouts),
        ("/runs/{run_id}/rollouts/{rollout_id}", one_rollout),
        ("/runs/{run_id}/rollouts/{rollout_id}/timeline", rollout_timeline),
        ("/calls/{seq:int}", one_call),
    ]
    for path, fetch in routes:
        app.add_api_route(api + path, _handler(authorize, fetch), methods=["GET"], include_in_schema=False)

    async def to_index(request: Request) -> Response:
        return RedirectResponse(f"{prefix}/")

    app.add_api_route(prefix, to_index, methods=["GET"], include_in_schema=False)
    app.mount(prefix, StaticFiles(directory=STATIC, html=True), name="viewer")
