"""The projector's OpenAPI document, built from its own route table (so a new route is in it).

    GET /openapi.json      (no token needed: the document holds no data)

Every route is a GET answering JSON; an error is `{"error": "..."}` (with `applied_seq` and
`min_seq` on a 503 for a `min_seq` the projection has not reached). The viewer's static page is
the mount at `/ui`, listed as `/ui/{path}`.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Mount

from schemas.bounds import JSON_INT_MAX, PAGE_MAX
from schemas.ids import ID_PATTERN, MAX_ID_LENGTH

OPEN = ("/metrics", "/healthz", "/health", "/openapi.json", "/ui", "/ui/{path}")
"""Paths served without a token; everything else needs the admin token when the projector has one."""
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}, "applied_seq": {"type": "integer"}, "min_seq": {"type": "integer"}},
}
_ID = {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH, "pattern": ID_PATTERN}
_WAITS = ("/query/", "/api/", "/ui/api/")
"""Prefixes whose GETs take `min_seq` (see `api.MinSeqMiddleware`)."""


def _int(name: str, low: int = 0, high: int = PAGE_MAX) -> dict[str, Any]:
    return {"name": name, "in": "query", "schema": {"type": "integer", "minimum": low, "maximum": high}}


def _text(name: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "schema": {"type": "string"}}


QUERY: dict[str, list[dict[str, Any]]] = {
    "/query/rollouts": [
        _text("run_id"),
        _text("status"),
        _text("group_id"),
        _text("mode"),
        _int("limit", 1),
        _int("cursor"),
    ],
    "/query/terminal": [_int("after"), _int("limit", 1)],
    "/query/rollouts/{rollout_id}": [_text("run_id")],
    "/query/rollouts/{rollout_id}/events": [_text("run_id")],
    "/api/runs": [_int("limit", 1)],
    "/ui/api/runs/{run_id}/rollouts": [
        _text("sort"),
        _text("desc"),
        _text("status"),
        _text("flagged"),
        _text("q"),
        _int("limit", 1, 1000),
        _int("offset"),
    ],
    "/ui/api/runs/{run_id}/rollouts/{rollout_id}/timeline": [_int("after_seq"), _int("limit", 1, 10_000)],
}
MIN_SEQ = _int("min_seq", 0, JSON_INT_MAX)


def served_routes(app: FastAPI) -> list[str]:
    """Every path the projector answers (all GET): its API routes and the viewer's static mount."""
    paths = [re.sub(r"{(\w+):\w+}", r"{\1}", r.path) for r in app.routes if isinstance(r, APIRoute)]
    paths += [f"{r.path}/{{path}}" for r in app.routes if isinstance(r, Mount)]
    return sorted(set(paths))


def _parameters(path: str) -> list[dict[str, Any]]:
    parameters: list[dict[str, Any]] = []
    for name in re.findall(r"{(\w+)}", path):
        if name == "seq":
            schema: dict[str, Any] = {"type": "integer", "minimum": 0}
        else:
            schema = {"type": "string"} if name == "path" else _ID
        parameters.append({"name": name, "in": "path", "required": True, "schema": schema})
    parameters += QUERY.get(path, [])
    if path.startswith(_WAITS):
        parameters.append(MIN_SEQ)
    return parameters


def _operation(path: str) -> dict[str, Any]:
    json: dict[str, Any] = {"application/json": {"schema": {}}}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    if path == "/metrics":
        ok: dict[str, Any] = {"description": "Prometheus exposition", "content": {"text/plain": {"schema": {}}}}
    elif path.startswith("/ui") and not path.startswith("/ui/api/"):
        ok = {"description": "the viewer's page and files"}
    else:
        ok = {"description": "the answer", "content": json}
    operation: dict[str, Any] = {
        "summary": f"GET {path}",
        "responses": {
            "200": ok,
            "4XX": {
                "description": "refused: no admin token (401), nothing there (404), a bad parameter (422)",
                "content": error,
            },
            "503": {"description": "Postgres unavailable, or `min_seq` not reached in time", "content": error},
        },
    }
    if path == "/ui":
        operation["responses"]["307"] = {"description": "to `/ui/`"}
    parameters = _parameters(path)
    if parameters:
        operation["parameters"] = parameters
    if path not in OPEN:
        operation["security"] = [{"bearer": []}]
    return operation


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """OpenAPI 3.1 for every route of the projector's app."""
    return {
        "openapi": "3.1.0",
        "info": {"title": app.title, "version": app.version},
        "paths": {path: {"get": _operation(path)} for path in served_routes(app)},
        "components": {
            "schemas": {"Error": ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
