"""The projector's `GET /openapi.json`: every route of its app, each with its parameters and error object."""

from __future__ import annotations

import httpx
from projector_support import ServerThread

from services.projector.api import create_query_app
from services.projector.openapi import served_routes
from services.projector.reader import PostgresRolloutReader


def test_the_projector_documents_every_route(database: str) -> None:
    app = create_query_app(PostgresRolloutReader(database), admin_token="doc-admin")
    with ServerThread(app) as server:
        response = httpx.get(f"{server.url}/openapi.json", timeout=10)  # no token: the document holds no data
    assert response.status_code == 200, response.text
    paths = response.json()["paths"]
    assert set(paths) == set(served_routes(app))
    assert {"/query/rollouts/{rollout_id}/events", "/api/runs", "/ui/api/calls/{seq}", "/ui/{path}"} <= set(paths)
    events = paths["/query/rollouts/{rollout_id}/events"]["get"]
    assert events["security"] == [{"bearer": []}]
    assert {p["name"] for p in events["parameters"]} == {"rollout_id", "run_id", "min_seq"}
    assert "security" not in paths["/ui/{path}"]["get"]
    error = events["responses"]["4XX"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/Error"}
