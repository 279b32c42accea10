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
    assert not undescribed, f"write routes whose body schema is missing (add them to api.routes.BODIES): {undescribed}"

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


def test_every_served_path_is_documented_with_its_real_error_object(gateway: GatewayHandle) -> None:
    """The proxy's front ends (each also under `agent/{agent}`), HEAD, `/metrics` and the viewer are in the
    document, and each error is declared as the object the gateway answers with."""
    paths = httpx.get(f"{gateway.url}/openapi.json", timeout=10).json()["paths"]
    base = "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}"
    for prefix in (base, base + "/agent/{agent}"):
        for path, method in [
            ("/openai/v1/chat/completions", "post"),
            ("/openai/v1/responses", "post"),
            ("/openai/v1/models", "get"),
            ("/anthropic/v1/messages", "post"),
            ("/anthropic/v1/messages/count_tokens", "post"),
            ("/anthropic/v1/models", "get"),
            ("/anthropic", "head"),
        ]:
            assert method in paths.get(prefix + path, {}), f"{method.upper()} {prefix + path} is not documented"
    for path in ("/metrics", "/ui", "/ui/{path}", "/openapi.json", "/api/runs", "/api/runs/{run_id}/summary"):
        assert "get" in paths.get(path, {}), f"GET {path} is not documented"

    def error_schema(path: str, method: str) -> dict[str, object]:
        schema = paths[path][method]["responses"]["4XX"]["content"]["application/json"]["schema"]
        assert paths[path][method]["responses"]["4XX"]["headers"]["x-should-retry"]
        return schema  # type: ignore[no-any-return]

    openai = error_schema(base + "/openai/v1/responses", "post")
    assert openai["properties"]["error"]["type"] == "object"  # type: ignore[index]
    assert {"message", "type", "code"} <= set(openai["properties"]["error"]["required"])  # type: ignore[index]
    anthropic = error_schema(base + "/anthropic/v1/messages", "post")
    assert anthropic["properties"]["type"] == {"const": "error"}  # type: ignore[index]
    assert anthropic["properties"]["error"]["type"] == "object"  # type: ignore[index]
    api = error_schema("/api/rollouts", "post")
    assert api["properties"]["error"] == {"type": "string"}  # type: ignore[index]
