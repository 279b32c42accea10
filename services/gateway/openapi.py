"""The gateway's OpenAPI document, built from its routes and the msgspec Structs of their bodies.

The routes decode their bodies with msgspec (a wrong type is a 422 naming the field), so FastAPI
cannot see the bodies and its generated document would be empty. This module builds the document
from the app's own route table instead: every `/api/...` and `/healthz` route appears with its
summary (the handler's docstring) and path parameters, and the routes in `BODIES` with the JSON
Schema of their body. The proxy, which is not a route, is added by hand.

    GET /openapi.json
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.routing import APIRoute

REF = "#/components/schemas/{name}"
PROXY_PATHS: dict[str, dict[str, Any]] = {
    "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/chat/completions": {
        "post": {
            "summary": "OpenAI chat completions for one attempt (attempt token); every call is recorded",
            "description": "Forwarded to the run's registered model with token ids and logprobs requested; "
            "the response is the upstream's, streamed or not. `mode` is `train` or `val`.",
            "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}},
        }
    },
    "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/models": {
        "get": {"summary": "The models the attempt may call (attempt token)"},
    },
}


def _summary(handler: Callable[..., Any]) -> tuple[str, str]:
    doc = inspect.getdoc(handler) or ""
    first, _, rest = doc.partition("\n")
    return first.strip(), rest.strip()


def _operation(path: str, summary: str, description: str) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK (JSON)"},
            "4XX": {"description": 'the request\'s mistake: `{"error": ...}` naming it'},
            "503": {"description": "NATS or Postgres unavailable: retry later"},
        },
    }
    if description:
        operation["description"] = description
    names = re.findall(r"{(\w+)}", path)
    if names:
        operation["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names
        ]
    if path != "/healthz":
        operation["security"] = [{"bearer": []}]
    return operation


def openapi_document(app: FastAPI, bodies: Mapping[Callable[..., Any], Any]) -> dict[str, Any]:
    """OpenAPI 3.1 for `app`'s API routes; `bodies` maps a handler to the type its JSON body decodes to."""
    documented = [
        route
        for route in app.routes
        if isinstance(route, APIRoute) and (route.path.startswith("/api/") or route.path == "/healthz")
    ]
    types = [bodies[route.endpoint] for route in documented if route.endpoint in bodies]
    body_schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    schema_of = dict(zip(types, body_schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for route in documented:
        summary, description = _summary(route.endpoint)
        for method in sorted(route.methods or ()):
            operation = _operation(route.path, summary, description)
            if route.endpoint in bodies:
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": schema_of[bodies[route.endpoint]]}},
                }
            paths.setdefault(route.path, {})[method.lower()] = operation
    for path, operations in PROXY_PATHS.items():
        paths[path] = {method: _operation(path, op["summary"], op.get("description", "")) | op
                       for method, op in operations.items()}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": app.title, "version": app.version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
