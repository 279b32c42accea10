"""Reads on the gateway's port, answered by the projector: one URL for users, one owner of the read side.

With `ROLLWIRE_PROJECTOR_URL` set, the gateway's reader is a `ProjectorReader` (the projector's
query API over HTTP) and this module adds what the projector serves as is:

- `GET /api/runs` and `GET /api/runs/{run_id}/summary` (admin), and the viewer under `/ui`
  (its page is open; its data, `/ui/api/...`, needs the admin token): forwarded, status and body
  unchanged. The gateway checks the caller first and calls the projector with its own admin token.
- `min_seq` on a GET under `/api/` or `/ui/api/`: once the caller is authenticated, the gateway
  asks the projector to wait until it has applied that stream sequence; a projection still behind
  after the projector's timeout is a 503 naming the applied sequence (read-your-writes).

Without a projector the gateway folds the stream for each read (`StreamRolloutReader`), which
always sees its own writes, so `min_seq` needs no wait and the summaries and viewer are absent.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request, Response

from services.common.readside import ProjectorReader, ReadSideError
from services.gateway.commands import checked_id
from services.gateway.errors import ApiError, translate

_FORWARDED_HEADERS = ("content-type", "cache-control", "etag", "last-modified", "location", "retry-after")


class ReadAfterWrite:
    """ASGI middleware: a GET with `?min_seq=N` (from an authenticated caller) waits for the projection."""

    def __init__(self, app: Any, prefixes: tuple[str, ...] = ("/api/", "/ui/api/")) -> None:
        self.app = app
        self.prefixes = prefixes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"].startswith(self.prefixes):
            raw = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("min_seq")
            gateway = scope["app"].state.gateway
            if raw and isinstance(gateway.reader, ProjectorReader):
                try:
                    gateway.principal(Request(scope))
                    await gateway.reader.wait_for(_min_seq(raw[-1]))
                except (ApiError, ReadSideError) as exc:
                    error = translate(exc)
                    assert error is not None
                    response = Response(
                        error.body(), status_code=error.status, media_type="application/json", headers=error.headers
                    )
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _min_seq(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ApiError(422, f"query parameter min_seq={raw!r} is not an integer", field="min_seq") from None


async def forward(request: Request) -> Response:
    """Pass a read to the projector after checking the caller (the viewer's page itself is open)."""
    gw = request.app.state.gateway
    path = request.url.path
    if path.startswith("/api/") or path.startswith("/ui/api/"):
        gw.admin(request)
    if "run_id" in request.path_params:  # bad input stops here, named as the gateway names it
        checked_id("run_id", request.path_params["run_id"])
    if not isinstance(gw.reader, ProjectorReader):
        raise ApiError(404, f"{path} is served by the projector; set ROLLWIRE_PROJECTOR_URL on the gateway")
    answer = await gw.reader.forward(path, request.scope.get("query_string", b""))
    headers = {k: v for k, v in answer.headers.items() if k.lower() in _FORWARDED_HEADERS}
    return Response(answer.content, status_code=answer.status_code, headers=headers)


def register(app: FastAPI) -> None:
    """Add the forwarded reads and the `min_seq` wait to the gateway app."""
    app.add_middleware(ReadAfterWrite)
    app.add_api_route("/api/runs", forward, methods=["GET"], include_in_schema=False)
    app.add_api_route("/api/runs/{run_id}/summary", forward, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui", forward, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/{path:path}", forward, methods=["GET"], include_in_schema=False)
