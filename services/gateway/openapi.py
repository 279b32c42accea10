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

from schemas.bounds import JSON_INT_MAX, PAGE_MAX
from schemas.ids import ID_PATTERN, MAX_ID_LENGTH

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


STATUSES = ["queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled"]
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}, "field": {"type": "string"}},
}
ROLLOUT = {
    "type": "object",
    "required": ["rollout_id", "run_id", "state", "status", "mode", "attempts"],
    "properties": {
        "rollout_id": {"type": "string"},
        "run_id": {"type": "string"},
        "state": {"enum": STATUSES},
        "status": {"type": "object", "required": ["state"]},
        "mode": {"enum": ["train", "val"]},
        "attempts": {"type": "array", "items": {"type": "string"}},
    },
}
SEQ = {"type": "integer", "minimum": 0}
RUN = {
    "type": "object",
    "required": ["run_id", "spec", "seq"],
    "properties": {"run_id": {"type": "string"}, "seq": SEQ},
}
ATTEMPT = {
    "type": "object",
    "required": ["attempt_id", "token", "proxy_base_url", "events_url"],
    "properties": {"attempt_id": {"type": "string"}, "token": {"type": "string"}},
}
EVENT = {"type": "object", "required": ["type", "seq"], "properties": {"type": {"type": "string"}, "seq": SEQ}}
OBJECT = {"type": "object"}
HEALTH = {
    "type": "object",
    "required": ["status", "nats"],
    "properties": {"status": {"enum": ["ok", "degraded"]}, "nats": {"type": "boolean"}, "reads": {"type": "boolean"}},
}

RESPONSES: dict[tuple[str, str], tuple[str, dict[str, Any] | None]] = {
    ("get", "/healthz"): ("200", HEALTH),
    ("post", "/api/rollouts"): ("201", {"anyOf": [
        {"type": "array", "items": ROLLOUT},
        {"type": "object", "required": ["rollouts", "seq"], "properties": {
            "rollouts": {"type": "array", "items": ROLLOUT}, "seq": SEQ}},
    ]}),
    ("get", "/api/rollouts"): ("200", {"type": "array", "items": ROLLOUT}),
    ("get", "/api/rollouts/terminal"): ("200", {
        "type": "object", "required": ["items", "next_after", "total_terminal"]}),
    ("get", "/api/rollouts/{rollout_id}"): ("200", ROLLOUT),
    ("patch", "/api/rollouts/{rollout_id}"): ("200", ROLLOUT),
    ("delete", "/api/rollouts/{rollout_id}"): ("204", None),
    ("post", "/api/rollouts/{rollout_id}/attempts"): ("201", ATTEMPT),
    ("post", "/api/rollouts/{rollout_id}/attempt/{attempt_id}/evaluator-token"): ("201", {
        "type": "object", "required": ["token", "rollout_id", "attempt_id"]}),
    ("post", "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"): ("201", EVENT),
    ("get", "/api/rollouts/{rollout_id}/events"): ("200", {"type": "array", "items": OBJECT}),
    ("post", "/api/models"): ("201", {"anyOf": [{"type": "array", "items": OBJECT}, OBJECT]}),
    ("delete", "/api/models"): ("200", {"type": "object", "required": ["removed", "seq"]}),
    ("post", "/api/runs"): ("201", RUN),
    ("get", "/api/runs"): ("200", {"type": "object", "required": ["runs", "applied_seq"]}),
    ("get", "/api/runs/{run_id}"): ("200", {"type": "object", "required": ["run_id", "spec", "rollouts"]}),
    ("get", "/api/runs/{run_id}/summary"): ("200", OBJECT),
    ("post", "/api/phase"): ("200", {"type": "object", "required": ["run_id", "phase", "seq"]}),
}  # fmt: skip
"""Each operation's success status and the JSON Schema of its body (None: no body)."""

EXTRA_SUCCESS = {("post", "/api/runs"): "200"}
"""Operations with a second success status (`POST /api/runs` with the same spec again: 200)."""


def _int(name: str, minimum: int, description: str, maximum: int = PAGE_MAX) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": "integer", "minimum": minimum, "maximum": maximum}}  # fmt: skip


def _text(name: str, description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema or {"type": "string"}}  # fmt: skip


ID_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH, "pattern": ID_PATTERN}
STATUS_LIST = {"type": "array", "items": {"enum": STATUSES}}
QUERY: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("get", "/api/rollouts"): [
        {**_text("state_in", "statuses to list (repeat, or comma-separate)", STATUS_LIST), "explode": True},
        {**_text("status", "same as state_in", STATUS_LIST), "explode": True},
        _text("run_id", "only this run", ID_SCHEMA),
        _text("group_id", "only this group"),
        _text("mode", "train or val", {"enum": ["train", "val"]}),
        _int("limit", 1, "page size (default 500)"),
        _int("cursor", 0, "the x-next-cursor of the previous page"),
    ],
    ("get", "/api/rollouts/terminal"): [_int("after", 0, "skip this many"), _int("limit", 1, "page size")],
    ("get", "/api/rollouts/{rollout_id}/events"): [
        _text("type", "event types, comma-separated (default: rewards, custom events and calls)"),
        _text("event_type", "Agent Lightning's event type"),
        _text("attempt_id", "only this attempt"),
        _text("format", "`triplet` for Agent Lightning's triplets"),
    ],
    ("delete", "/api/models"): [_text("name", "the model to remove (default: all)"), _text("run_id", "only this run")],
    ("get", "/api/runs"): [_int("limit", 1, "how many runs (default 200)")],
}
OPTIONAL_BODY = {"/api/rollouts/{rollout_id}/attempts"}
"""Routes whose body may be left out (an empty body means `{}`)."""

_NAME = {"type": ["string", "null"]}
EVENT_BODY = {
    "description": "a reward, a custom event, or Agent Lightning's EventCreate",
    "anyOf": [
        {"type": "object", "required": ["type", "value"], "properties": {
            "type": {"const": "reward"}, "value": {"type": "number"}, "name": _NAME,
            "step": {"type": ["integer", "null"], "minimum": -(2**31), "maximum": 2**31 - 1}}},
        {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "custom"}, "name": ID_SCHEMA, "payload": {"type": ["object", "null"]}}},
        {"type": "object", "required": ["event_type", "data"], "properties": {
            "type": {"type": "null"}, "event_type": {"const": "reward"},
            "data": {"type": "object", "required": ["value"], "properties": {"value": {"type": "number"}}}}},
        {"type": "object", "required": ["event_type"], "properties": {
            "type": {"type": "null"}, "event_type": {**ID_SCHEMA, "not": {"enum": ["reward", "model_request"]}},
            "data": {"type": ["object", "null"]}}},
    ],
}  # fmt: skip

MIN_SEQ = _int(
    "min_seq", 0, "answer only once the projection has applied this stream sequence (503 after a wait)", JSON_INT_MAX
)


def _summary(handler: Callable[..., Any]) -> tuple[str, str]:
    doc = inspect.getdoc(handler) or ""
    first, _, rest = doc.partition("\n")
    return first.strip(), rest.strip()


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation(method: str, path: str, summary: str, description: str, read_side: bool) -> dict[str, Any]:
    status, schema = RESPONSES.get((method, path), ("200", OBJECT))
    ok: dict[str, Any] = {"description": "done"}
    if schema is not None:
        ok["content"] = _json(schema)
    responses: dict[str, Any] = {status: ok}
    if (method, path) in EXTRA_SUCCESS:
        responses[EXTRA_SUCCESS[(method, path)]] = {"description": "already so", "content": _json(schema or OBJECT)}
    responses["4XX"] = {"description": 'the request\'s mistake: `{"error": ...}` naming it', "content": _json(ERROR)}
    unavailable = HEALTH if path == "/healthz" else ERROR
    responses["503"] = {"description": "NATS or Postgres unavailable: retry later", "content": _json(unavailable)}
    if path == "/api/phase":
        responses["504"] = {"description": "calls still in flight after the drain timeout", "content": _json(ERROR)}
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if description:
        operation["description"] = description
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": ID_SCHEMA} for name in re.findall(r"{(\w+)}", path)
    ]
    parameters += QUERY.get((method, path), [])
    if read_side and method == "get" and path.startswith("/api/"):
        parameters.append(MIN_SEQ)
    if parameters:
        operation["parameters"] = parameters
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
    read_side = bool(getattr(app.state, "read_side", False))
    types = [bodies[route.endpoint] for route in documented if route.endpoint in bodies]
    body_schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    schema_of = dict(zip(types, body_schemas, strict=True))
    if "NewRollout" in components:  # required, and never null (a task needs an input)
        components["NewRollout"]["properties"]["input"] = {"not": {"type": "null"}}
    if "RunSpec" in components:  # what RunSpec.__post_init__ checks
        components["RunSpec"]["if"] = {"required": ["reward_from"], "properties": {
            "reward_from": {"const": "evaluator"}, "backend": {"const": "local"}}}  # fmt: skip
        components["RunSpec"]["then"] = {
            "required": ["evaluator_command"],
            "properties": {"evaluator_command": {"type": "array", "minItems": 1}},
        }
    if "EventBody" in components:  # the shapes the handler accepts, which msgspec cannot say
        components["EventBody"] = EVENT_BODY
    paths: dict[str, dict[str, Any]] = {}
    for route in documented:
        summary, description = _summary(route.endpoint)
        for method in sorted(route.methods or ()):
            operation = _operation(method.lower(), route.path, summary, description, read_side)
            if route.endpoint in bodies:
                operation["requestBody"] = {
                    "required": route.path not in OPTIONAL_BODY,
                    "content": {"application/json": {"schema": schema_of[bodies[route.endpoint]]}},
                }
            paths.setdefault(route.path, {})[method.lower()] = operation
    for path, operations in PROXY_PATHS.items():
        paths[path] = {method: _operation(method, path, op["summary"], op.get("description", ""), False) | op
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
