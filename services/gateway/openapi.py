"""The gateway's OpenAPI document, built from everything it serves and the msgspec Structs of the bodies.

The routes decode their bodies with msgspec (a wrong type is a 422 naming the field), so FastAPI
cannot see the bodies and its generated document would be empty. This module builds the document
from what the gateway serves instead (`served_routes`): every FastAPI route (the rollout API, the
reads forwarded to the projector, the viewer under `/ui`, this document), every proxy route of
`proxy.ROUTES` (Chat Completions, Responses, models; Messages, `count_tokens`, Anthropic's models,
`HEAD`), each with and without an agent name in the path, and `/metrics`. Each error is declared
as the object it is: `{"error": "..."}` on the API, the OpenAI error object on `.../openai/v1/...`
and the Anthropic one on `.../anthropic/...`.

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
from services.common.metrics import METRICS_PATH
from services.gateway.proxy.handler import AGENT_BASE, PROXY_BASE, route_template
from services.gateway.proxy.handler import ROUTES as PROXY_ROUTES

REF = "#/components/schemas/{name}"
PROXY_SUMMARIES = {
    "chat/completions": "OpenAI Chat Completions for one attempt (its agent token); every call is recorded",
    "responses": "OpenAI Responses API for one attempt (its agent token); every call is recorded",
    "models": "The models the attempt may call (OpenAI's list)",
    "v1/messages": "Anthropic Messages API for one attempt (its agent token); every call is recorded",
    "v1/messages/count_tokens": "Anthropic count_tokens: the exact prompt length the engine would consume",
    "v1/models": "The models the attempt may call (Anthropic's list)",
    "": "Anthropic base URL: 200 for a harness's connectivity check (no token needed, nothing served)",
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
    "properties": {
        "status": {"enum": ["ok", "degraded"]},
        "nats": {"type": "boolean"},
        "store": {"enum": ["refusing writes"], "description": "present only while the store is full"},
        "reason": {"type": "string", "description": "why the store refuses writes (it is full)"},
        "reads": {"type": "boolean"},
    },
}

RESPONSES: dict[tuple[str, str], tuple[str, dict[str, Any] | None]] = {
    ("get", "/healthz"): ("200", HEALTH),
    ("post", "/api/rollouts"): (
        "201",
        {
            "anyOf": [
                {"type": "array", "items": ROLLOUT},
                {
                    "type": "object",
                    "required": ["rollouts", "seq"],
                    "properties": {"rollouts": {"type": "array", "items": ROLLOUT}, "seq": SEQ},
                },
            ]
        },
    ),
    ("get", "/api/rollouts"): ("200", {"type": "array", "items": ROLLOUT}),
    ("get", "/api/rollouts/terminal"): (
        "200",
        {"type": "object", "required": ["items", "next_after", "total_terminal"]},
    ),
    ("get", "/api/rollouts/{rollout_id}"): ("200", ROLLOUT),
    ("patch", "/api/rollouts/{rollout_id}"): ("200", ROLLOUT),
    ("delete", "/api/rollouts/{rollout_id}"): ("204", None),
    ("post", "/api/rollouts/{rollout_id}/attempts"): ("201", ATTEMPT),
    ("post", "/api/rollouts/{rollout_id}/attempt/{attempt_id}/evaluator-token"): (
        "201",
        {"type": "object", "required": ["token", "rollout_id", "attempt_id"]},
    ),
    ("post", "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events"): ("201", EVENT),
    ("get", "/api/rollouts/{rollout_id}/events"): ("200", {"type": "array", "items": OBJECT}),
    ("post", "/api/models"): ("201", {"anyOf": [{"type": "array", "items": OBJECT}, OBJECT]}),
    ("delete", "/api/models"): ("200", {"type": "object", "required": ["removed", "seq"]}),
    ("post", "/api/runs"): ("201", RUN),
    ("get", "/api/runs"): ("200", {"type": "object", "required": ["runs", "applied_seq"]}),
    ("get", "/api/runs/{run_id}"): ("200", {"type": "object", "required": ["run_id", "spec", "rollouts"]}),
    ("get", "/api/runs/{run_id}/summary"): ("200", OBJECT),
    ("post", "/api/phase"): ("200", {"type": "object", "required": ["run_id", "phase", "seq"]}),
}
"""Each operation's success status and the JSON Schema of its body (None: no body)."""

EXTRA_SUCCESS = {("post", "/api/runs"): "200"}
"""Operations with a second success status (`POST /api/runs` with the same spec again: 200)."""


def _int(name: str, minimum: int, description: str, maximum: int = PAGE_MAX) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": {"type": "integer", "minimum": minimum, "maximum": maximum},
    }


def _text(name: str, description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema or {"type": "string"},
    }


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
        {
            "type": "object",
            "required": ["type", "value"],
            "properties": {
                "type": {"const": "reward"},
                "value": {"type": "number"},
                "name": _NAME,
                "step": {"type": ["integer", "null"], "minimum": -(2**31), "maximum": 2**31 - 1},
            },
        },
        {
            "type": "object",
            "required": ["type", "name"],
            "properties": {"type": {"const": "custom"}, "name": ID_SCHEMA, "payload": {"type": ["object", "null"]}},
        },
        {
            "type": "object",
            "required": ["event_type", "data"],
            "properties": {
                "type": {"type": "null"},
                "event_type": {"const": "reward"},
                "data": {"type": "object", "required": ["value"], "properties": {"value": {"type": "number"}}},
            },
        },
        {
            "type": "object",
            "required": ["event_type"],
            "properties": {
                "type": {"type": "null"},
                "event_type": {**ID_SCHEMA, "not": {"enum": ["reward", "model_request"]}},
                "data": {"type": ["object", "null"]},
            },
        },
    ],
}

MIN_SEQ = _int(
    "min_seq", 0, "answer only once the projection has applied this stream sequence (503 after a wait)", JSON_INT_MAX
)


OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": ["integer", "string", "null"]},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}
"""The error of every `.../openai/v1/...` answer (Chat Completions and Responses alike), as the SDK reads it."""
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
"""The error of every `.../anthropic/...` answer, as the anthropic SDK reads it."""
NO_RETRY = {
    "x-should-retry": {
        "description": "`false` on every permanent refusal (401, 403, 404, 409, 413, 422): SDKs do not retry it",
        "schema": {"enum": ["false"]},
    }
}
OPEN = {"/healthz", "/openapi.json", METRICS_PATH}
"""Paths served without a token."""


def served_routes(app: FastAPI) -> list[tuple[str, str]]:
    """Every (method, path template) the gateway answers: its FastAPI routes, the proxy's routes (each
    also under `agent/{agent}`) and `/metrics`. The OpenAPI document and the auth tests both start here."""
    served = [
        (method, re.sub(r"{(\w+):\w+}", r"{\1}", route.path))  # `{path:path}` is `{path}` to OpenAPI
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods or ()
    ]
    for (api, method, rest), _ in PROXY_ROUTES.items():
        for base in (PROXY_BASE, AGENT_BASE):
            served.append((method, route_template(api, rest, base)))
    served.append(("GET", METRICS_PATH))
    return sorted(set(served))


def _summary(handler: Callable[..., Any]) -> tuple[str, str]:
    doc = inspect.getdoc(handler) or ""
    first, _, rest = doc.partition("\n")
    return first.strip(), rest.strip()


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _path_parameters(path: str) -> list[dict[str, Any]]:
    parameters = []
    for name in re.findall(r"{(\w+)}", path):
        schema = {"enum": ["train", "val"]} if name == "mode" else ({"type": "string"} if name == "path" else ID_SCHEMA)
        parameters.append({"name": name, "in": "path", "required": True, "schema": schema})
    return parameters


def _operation(method: str, path: str, summary: str, description: str, read_side: bool) -> dict[str, Any]:
    status, schema = RESPONSES.get((method, path), ("200", OBJECT))
    ok: dict[str, Any] = {"description": "done"}
    if schema is not None:
        ok["content"] = _json(schema)
    responses: dict[str, Any] = {status: ok}
    if (method, path) in EXTRA_SUCCESS:
        responses[EXTRA_SUCCESS[(method, path)]] = {"description": "already so", "content": _json(schema or OBJECT)}
    responses["4XX"] = {
        "description": 'the request\'s mistake: `{"error": ...}` naming it',
        "content": _json(ERROR),
        "headers": NO_RETRY,
    }
    unavailable = HEALTH if path == "/healthz" else ERROR
    responses["503"] = {"description": "NATS or Postgres unavailable: retry later", "content": _json(unavailable)}
    if path == "/api/phase":
        responses["504"] = {"description": "calls still in flight after the drain timeout", "content": _json(ERROR)}
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if description:
        operation["description"] = description
    parameters = _path_parameters(path) + QUERY.get((method, path), [])
    if read_side and method == "get" and path.startswith("/api/"):
        parameters.append(MIN_SEQ)
    if parameters:
        operation["parameters"] = parameters
    if path not in OPEN:
        operation["security"] = [{"bearer": []}]
    return operation


def _proxy_operation(method: str, path: str) -> dict[str, Any]:
    """A proxy route: the request is the API's own (any JSON object), errors in that API's shape."""
    rest = path.split("/openai/v1/", 1)[1] if "/openai/v1/" in path else path.split("/anthropic", 1)[1].lstrip("/")
    error = _json(OPENAI_ERROR if "/openai/v1/" in path else ANTHROPIC_ERROR)
    ok: dict[str, Any] = {"description": "the API's answer (`text/event-stream` when the request streams)"}
    if method != "head":
        ok["content"] = {**_json(OBJECT), "text/event-stream": {"schema": {"type": "string"}}}
    operation: dict[str, Any] = {
        "summary": PROXY_SUMMARIES[rest],
        "parameters": _path_parameters(path),
        "responses": {
            "200": ok,
            "4XX": {
                "description": "refused (nothing generated), in the API's error shape",
                "content": error,
                "headers": NO_RETRY,
            },
            "5XX": {"description": "the engine or the event store failed; the call may be retried", "content": error},
        },
    }
    if method == "post":
        operation["requestBody"] = {"required": True, "content": _json(OBJECT)}
    if method != "head":
        operation["security"] = [{"bearer": []}, {"api_key": []}]
    return operation


def _other_operation(method: str, path: str) -> dict[str, Any]:
    """`/metrics`, `/openapi.json` and the viewer (forwarded to the projector)."""
    if path == METRICS_PATH:
        text = {"text/plain": {"schema": {"type": "string"}}}
        return {
            "summary": "Prometheus metrics (no run, rollout or attempt ids in them)",
            "responses": {"200": {"description": "the exposition", "content": text}},
        }
    if path == "/openapi.json":
        return {
            "summary": "This document",
            "responses": {"200": {"description": "OpenAPI 3.1", "content": _json(OBJECT)}},
        }
    refused = {
        "description": "not found, or a path that is not canonical",
        "content": _json(ERROR),
        "headers": NO_RETRY,
    }
    return {
        "summary": "The trajectory viewer, served by the projector: its page is open, its data (`/ui/api/...`) "
        "needs the admin token",
        "parameters": _path_parameters(path),
        "responses": {
            "200": {"description": "a file of the page, or the viewer's data"},
            "307": {"description": "to `/ui/`"},
            "4XX": refused,
            "503": {"description": "the projector cannot be reached", "content": _json(ERROR)},
        },
        "security": [{}, {"bearer": []}],
    }


def openapi_document(app: FastAPI, bodies: Mapping[Callable[..., Any], Any]) -> dict[str, Any]:
    """OpenAPI 3.1 for everything `app` serves (`served_routes`); `bodies` maps a handler to the type its
    JSON body decodes to."""
    handlers = {(m, r.path): r.endpoint for r in app.routes if isinstance(r, APIRoute) for m in r.methods or ()}
    read_side = bool(getattr(app.state, "read_side", False))
    types = list(dict.fromkeys(bodies[h] for h in handlers.values() if h in bodies))
    body_schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    schema_of = dict(zip(types, body_schemas, strict=True))
    _refine(components)
    components |= {"ApiError": ERROR, "OpenAIError": OPENAI_ERROR, "AnthropicError": ANTHROPIC_ERROR}
    paths: dict[str, dict[str, Any]] = {}
    for method, path in served_routes(app):
        handler = handlers.get((method, path))
        if path.startswith("/proxy/"):
            operation = _proxy_operation(method.lower(), path)
        elif path.startswith("/api/") or path == "/healthz":
            summary, description = _summary(handler) if handler else ("", "")
            operation = _operation(method.lower(), path, summary, description, read_side)
            if handler is not None and handler in bodies:
                operation["requestBody"] = {
                    "required": path not in OPTIONAL_BODY,
                    "content": {"application/json": {"schema": schema_of[bodies[handler]]}},
                }
        else:
            operation = _other_operation(method.lower(), path)
        paths.setdefault(path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": app.title, "version": app.version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }


def _refine(components: dict[str, Any]) -> None:
    """What the handlers check beyond the Structs' own schemas."""
    if "NewRollout" in components:  # required, and never null (a task needs an input)
        components["NewRollout"]["properties"]["input"] = {"not": {"type": "null"}}
    if "RunSpec" in components:  # what RunSpec.__post_init__ checks
        components["RunSpec"]["if"] = {
            "required": ["reward_from"],
            "properties": {"reward_from": {"const": "evaluator"}, "backend": {"const": "local"}},
        }
        components["RunSpec"]["then"] = {
            "required": ["evaluator_command"],
            "properties": {"evaluator_command": {"type": "array", "minItems": 1}},
        }
    if "EventBody" in components:  # the shapes the handler accepts, which msgspec cannot say
        components["EventBody"] = EVENT_BODY
