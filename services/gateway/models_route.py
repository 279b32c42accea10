"""`GET /api/models` (admin): the inference endpoints the proxy routes to, as the registry holds them."""

from __future__ import annotations

from fastapi import Request, Response

from schemas import InvalidId, check_id
from services.gateway.context import Gateway
from services.gateway.errors import from_validation
from services.gateway.http import json_response


async def list_models(request: Request) -> Response:
    """Registered endpoints, by run then name; `?run_id=` keeps one run's. API keys are never returned."""
    gw: Gateway = request.app.state.gateway
    gw.admin(request)
    run_id = request.query_params.get("run_id")
    if run_id is not None:
        try:
            check_id("run_id", run_id)
        except InvalidId as exc:
            raise from_validation(exc) from None
    models = [
        {
            "run_id": entry.run_id,
            "name": entry.name,
            "base_url": entry.base_url,
            "served_model": entry.upstream_model,
            "weights_version": entry.weights_version,
            "has_api_key": entry.api_key is not None,
            "seq": entry.seq,
        }
        for (run, name), entry in sorted(gw.state.models.items())
        if run_id is None or run == run_id
    ]
    return json_response({"models": models, "default_run": gw.settings.default_run})
