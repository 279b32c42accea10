"""Reads on the gateway's port, answered by the projector: one URL for users, one owner of the read side.

With `ROLLWIRE_PROJECTOR_URL` set, the gateway's reader is a `ProjectorReader` (the projector's
query API over HTTP) and this module adds what the projector serves as is:

- `GET /api/runs` and `GET /api/runs/{run_id}/summary` (admin), and the viewer under `/ui`
  (its page is open; its data, `/ui/api/...`, needs the admin token): forwarded, status and body
  unchanged.
- `min_seq` on a GET under `/api/` or `/ui/api/`: once the caller is authenticated, the gateway
  asks the projector to wait until it has applied that stream sequence; a projection still behind
  after the projector's timeout is a 503 naming the applied sequence (read-your-writes).

A forwarded path is authorised as the projector will serve it. The path is taken as the server
decoded it (`%2e` is a dot, `%2f` a slash), and anything that a client, proxy or server could
rewrite into another path is refused with a 404: a `.` or `..` segment, an empty segment (`//`),
a backslash. What is left is one canonical path, which is what gets checked (case-insensitively:
`/UI/API/...` is the viewer's data too) and what gets forwarded, each segment percent-encoded
again, so the projector decodes exactly the segments that were authorised. And a forward carries
the caller's own token, never the gateway's: the projector checks it again, so a read through
the gateway has no more rights than its caller.

Without a projector the gateway folds the stream for each read (`StreamRolloutReader`), which
always sees its own writes, so `min_seq` needs no wait and the summaries and viewer are absent.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import FastAPI, Request, Response

from services.common.readside import ProjectorReader, ReadSideError
from services.gateway.api.commands import checked_id
from services.gateway.auth import Admin, AttemptScope, Principal
from services.gateway.errors import ApiError, not_found, translate

_FORWARDED_HEADERS = ("content-type", "cache-control", "etag", "last-modified", "location", "retry-after")
VIEWER = "/ui"
_OWN_ROLLOUT_READS = re.compile(r"^/api/rollouts/([^/]+)(?:/events)?$")
"""The GETs an attempt token may make (its own rollout and its events): the only ones it may wait on."""


def canonical_path(path: str) -> str:
    """`path` (as decoded by the server) if it has one meaning wherever it goes, else a 404.

    Refused: `.` and `..` segments (a client or server may resolve them into another path), empty
    segments other than a trailing slash (`//`), and backslashes (a separator on some systems).
    Ids never contain `.`, `/` or whitespace, so no valid read is refused.
    """
    segments = path.split("/")
    if (
        not path.startswith("/")
        or "\\" in path
        or any(s in (".", "..") for s in segments)
        or any(s == "" for s in segments[1:-1])
    ):
        raise not_found(
            f"{path!r} is not a canonical path (dot segments, empty segments and backslashes are refused); "
            "request the path itself"
        )
    return path


def is_viewer_page(path: str) -> bool:
    """True for the viewer's static page and files (open); false for its data and everything else (admin)."""
    lowered = path.lower()
    if lowered != VIEWER and not lowered.startswith(VIEWER + "/"):
        return False
    return not (lowered == f"{VIEWER}/api" or lowered.startswith(f"{VIEWER}/api/"))


def _caller_token(request: Request) -> str | None:
    """The caller's own token, as sent (Bearer or Agent Lightning's x-api-key)."""
    authorization = request.headers.get("authorization") or ""
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return (request.headers.get("x-api-key") or "").strip() or None


class ReadAfterWrite:
    """ASGI middleware: a GET with `?min_seq=N` (from a caller who may read the path) waits for the projection."""

    def __init__(self, app: Any, prefixes: tuple[str, ...] = ("/api/", "/ui/api/")) -> None:
        self.app = app
        self.prefixes = prefixes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"].startswith(self.prefixes):
            raw = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("min_seq")
            gateway = scope["app"].state.gateway
            if raw and isinstance(gateway.reader, ProjectorReader):
                try:
                    if _may_wait(gateway.principal(Request(scope)), scope["path"]):
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


def _may_wait(principal: Principal, path: str) -> bool:
    """Whether the caller may be kept waiting for this path: the admin, or an attempt token on its own
    rollout's reads. Anyone else is refused by the route at once, without the wait."""
    if isinstance(principal, Admin):
        return True
    own = _OWN_ROLLOUT_READS.match(path)
    return isinstance(principal, AttemptScope) and own is not None and own.group(1) == principal.rollout_id


def _min_seq(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ApiError(422, f"query parameter min_seq={raw!r} is not an integer", field="min_seq") from None


async def forward(request: Request) -> Response:
    """Pass a read to the projector, authorised on the path it will serve, with the caller's own token."""
    gw = request.app.state.gateway
    path = canonical_path(request.scope["path"])
    token: str | None = None
    if not is_viewer_page(path):
        gw.admin(request)
        token = _caller_token(request)
    if "run_id" in request.path_params:  # bad input stops here, named as the gateway names it
        checked_id("run_id", request.path_params["run_id"])
    if not isinstance(gw.reader, ProjectorReader):
        raise ApiError(404, f"{path} is served by the projector; set ROLLWIRE_PROJECTOR_URL on the gateway")
    encoded = "/".join(quote(segment, safe="") for segment in path.split("/"))
    answer = await gw.reader.forward(encoded, request.scope.get("query_string", b""), token=token)
    headers = {k: v for k, v in answer.headers.items() if k.lower() in _FORWARDED_HEADERS}
    return Response(answer.content, status_code=answer.status_code, headers=headers)


def register(app: FastAPI) -> None:
    """Add the forwarded reads and the `min_seq` wait to the gateway app."""
    app.add_middleware(ReadAfterWrite)
    app.add_api_route("/api/runs", forward, methods=["GET"], include_in_schema=False)
    app.add_api_route("/api/runs/{run_id}/summary", forward, methods=["GET"], include_in_schema=False)
    app.add_api_route(VIEWER, forward, methods=["GET"], include_in_schema=False)
    app.add_api_route(VIEWER + "/{path:path}", forward, methods=["GET"], include_in_schema=False)
