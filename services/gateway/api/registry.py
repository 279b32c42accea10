"""Models (where proxy calls go) and runs (how their rollouts execute): registered as events."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from fastapi import Request, Response

from schemas import (
    InvalidId,
    ModelRegistered,
    ModelRemoved,
    RunStarted,
)
from schemas.ids import RUN_SUBJECT
from schemas.run import InvalidRunSpec, spec_of
from schemas.runs import RunSpec
from services.common.eventstore import ConcurrencyConflict
from services.gateway.api import bodies
from services.gateway.api.commands import (
    checked_id,
    event_id_for,
    gateway_of,
    keyed,
)
from services.gateway.errors import ApiError, from_validation, not_found
from services.gateway.http import decode, encode, json_response, read_body
from services.gateway.idempotency import Result, derive_id

_SLUG = re.compile(r"[^A-Za-z0-9_-]+")
_SHOWN = ("name", "base_url", "run_id", "served_model", "weights_version", "tokenizer", "reasoning_parser", "adapters")
"""The fields of a registered model that its registration answers with (the API key is not among them)."""


async def register_models(request: Request) -> Response:
    """`POST /api/models` (admin): Agent Lightning's `[{model, endpoint, version}]` or `{name, base_url, ...}`."""
    gw = gateway_of(request)
    gw.admin(request)
    body = await read_body(request, gw.settings.max_body_bytes)
    parsed = decode(body, list[bodies.AglModel] | bodies.ModelBody)  # type: ignore[arg-type]

    async def command(key: str | None) -> Result:
        if isinstance(parsed, bodies.ModelBody):
            run_id = checked_id("run_id", parsed.run_id or gw.settings.default_run)
            try:
                event = ModelRegistered(
                    event_id=event_id_for(key, "model", run_id, parsed.name),
                    run_id=run_id,
                    name=parsed.name,
                    base_url=parsed.base_url,
                    served_model=parsed.served_model,
                    weights_version=parsed.weights_version,
                    api_key=parsed.api_key,
                    tokenizer=parsed.tokenizer,
                    reasoning_parser=parsed.reasoning_parser,
                    adapters=parsed.adapters,
                )
            except (InvalidId, msgspec.ValidationError) as exc:
                raise from_validation(exc) from None
            ack = await gw.append_registry(event)
            return 201, encode({**{key: getattr(event, key) for key in _SHOWN}, "seq": ack.seq})
        out = []
        for index, model in enumerate(parsed):
            name = _agl_model_name(model.model, model.endpoint)
            event = ModelRegistered(
                event_id=event_id_for(key, "model", str(index)),
                run_id=gw.settings.default_run,
                name=name,
                base_url=model.endpoint,
                served_model=model.model,
                weights_version=model.version,
            )
            ack = await gw.append_registry(event)
            out.append(
                {
                    "model": model.model,
                    "endpoint": model.endpoint,
                    "version": model.version,
                    "name": name,
                    "seq": ack.seq,
                }
            )
        return 201, encode(out)

    return await keyed(request, "admin", body, command)


def _agl_model_name(model: str, endpoint: str) -> str:
    """A subject-safe registry name for Agent Lightning's (model, endpoint) key."""
    slug = _SLUG.sub("_", model).strip("_")[:80] or "model"
    return f"{slug}-{derive_id(model, endpoint, length=10)}"


async def list_models(request: Request) -> Response:
    """`GET /api/models?run_id=` (admin): the registered endpoints (their `api_key` left out)."""
    gw = gateway_of(request)
    gw.admin(request)
    run_id = request.query_params.get("run_id")
    models = [
        {
            "name": m.name,
            "run_id": run,
            "base_url": m.base_url,
            "served_model": m.upstream_model,
            "weights_version": m.weights_version,
            "has_api_key": m.api_key is not None,
            "seq": m.seq,
        }
        for (run, _), m in sorted(gw.state.models.items())
        if run_id is None or run == run_id
    ]
    return json_response({"models": models})


async def delete_models(request: Request) -> Response:
    """`DELETE /api/models?name=&run_id=` (admin); without `name`, every model (Agent Lightning's shape)."""
    gw = gateway_of(request)
    gw.admin(request)
    name = request.query_params.get("name")
    run_id = request.query_params.get("run_id")
    removed = []
    seq = 0
    for (run, model_name), entry in list(gw.state.models.items()):
        if (name and model_name != name and entry.served_model != name) or (run_id and run != run_id):
            continue
        ack = await gw.append_registry(ModelRemoved(run_id=run, name=model_name))
        removed.append(model_name)
        seq = ack.seq
    if name and not removed:
        raise not_found(f"no model named {name} is registered")
    return json_response({"status": "ok", "removed": removed, "seq": seq})


async def start_run(request: Request) -> Response:
    """`POST /api/runs` (admin): record a run's spec (`RunStarted`); same spec again is a no-op."""
    gw = gateway_of(request)
    gw.admin(request)
    body = await read_body(request, gw.settings.max_body_bytes)
    spec = decode(body, RunSpec)
    config = msgspec.to_builtins(spec)

    async def command(key: str | None) -> Result:
        existing = await gw.store.last(RUN_SUBJECT.format(run=spec.run_id))  # the stream: no Postgres for a write
        if existing is not None and isinstance(existing.event, RunStarted):
            current = _stored_spec(existing.event)
            if current != spec:
                raise ApiError(
                    409,
                    f"run {spec.run_id} was already started with a different spec; a run's spec never changes: "
                    "resume it with the same settings, or start a new run id",
                    current=msgspec.to_builtins(current) if isinstance(current, RunSpec) else current,
                )
            return 200, encode({"run_id": spec.run_id, "spec": config, "seq": existing.seq})
        event = RunStarted(event_id=derive_id(spec.run_id, "run"), run_id=spec.run_id, name=spec.name, spec=spec)
        try:
            ack = await gw.append_registry(event, expected_last_subject_seq=0)
        except ConcurrencyConflict:
            raise ApiError(
                409, f"run {spec.run_id} was started concurrently; read it with GET /api/runs/{spec.run_id}"
            ) from None
        return 201, encode({"run_id": spec.run_id, "spec": config, "seq": ack.seq})

    return await keyed(request, "admin", body, command)


def _stored_spec(event: RunStarted) -> RunSpec | dict[str, Any]:
    """A stored run's spec (an older event's fields added since at their defaults, so it compares equal);
    an older event's invalid mapping as it is."""
    try:
        return spec_of(event)
    except InvalidRunSpec:
        return dict(event.config)
