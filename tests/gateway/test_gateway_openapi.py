"""`GET /openapi.json`: every API route documented, bodies as the JSON Schema the handlers decode."""

from __future__ import annotations

import httpx
from fastapi.routing import APIRoute
from gw_harness import GatewayHandle


def test_every_api_route_is_documented_with_its_body(gateway: GatewayHandle) -> None:
    response = httpx.get(f"{gateway.url}/openapi.json", timeout=10)
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.")
    paths = document["paths"]
    routes = {
        (route.path, method.lower())
        for route in gateway.app.routes
        if isinstance(route, APIRoute) and route.path.startswith("/api/")
        for method in route.methods or ()
    }
    assert routes, "the gateway has no API routes?"
    missing = sorted(f"{method.upper()} {path}" for path, method in routes if method not in paths.get(path, {}))
    assert not missing, f"routes without documentation: {missing}"
    for path, operations in paths.items():
        for method, operation in operations.items():
            assert operation["summary"], f"{method.upper()} {path} has no summary"

    bodyless = {("post", "/api/rollouts/{rollout_id}/attempt/{attempt_id}/evaluator-token")}
    undescribed = sorted(
        f"{method.upper()} {path}"
        for path, method in routes
        if method in ("post", "patch") and (method, path) not in bodyless and "requestBody" not in paths[path][method]
    )
    assert not undescribed, f"write routes whose body schema is missing (add them to api.BODIES): {undescribed}"

    components = document["components"]["schemas"]
    run_body = paths["/api/runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert run_body == {"$ref": "#/components/schemas/RunSpec"}
    run_spec = components["RunSpec"]
    assert {"run_id", "backend", "command", "concurrency", "max_attempts", "timeout_s"} <= set(run_spec["properties"])
    assert run_spec["required"] == ["run_id"]
    batch = paths["/api/rollouts"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(batch["anyOf"]) == 2  # Agent Lightning's bare list, or {"rollouts": [...]}
    assert "PhaseBody" in components and "EventBody" in components
    assert any(path.startswith("/proxy/rollout/") for path in paths)
    assert paths["/api/rollouts"]["get"]["security"] == [{"bearer": []}]
