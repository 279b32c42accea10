"""The rollout API: Agent Lightning 1.0's endpoints with their paths and shapes, plus Rollwire's.

Every command becomes events through the event store. A status change is checked against the
rollout's last status event, read fresh, and appended with that event's subject sequence, so two
writers never both win; the loser gets 409 with the current state. Every POST/PATCH honours
`Idempotency-Key` (see `services/gateway/idempotency.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from schemas.runs import RunSpec
from services.gateway.api import bodies
from services.gateway.api.events import post_event
from services.gateway.api.queries import get_rollout, get_run, healthz, list_events, list_rollouts, terminal_rollouts
from services.gateway.api.registry import delete_models, list_models, register_models, start_run
from services.gateway.api.rollouts import create_rollouts, delete_rollout, evaluator_token, patch_rollout, start_attempt

BODIES: dict[Callable[..., Any], Any] = {
    create_rollouts: list[bodies.NewRollout] | bodies.RolloutBatch,
    patch_rollout: bodies.RolloutPatch,
    start_attempt: bodies.NewAttempt,
    post_event: bodies.EventBody,
    register_models: list[bodies.AglModel] | bodies.ModelBody,
    start_run: RunSpec,
}
"""The JSON body each handler decodes, for the OpenAPI document (`services.gateway.openapi`)."""


def register(app: FastAPI) -> None:
    """Add the rollout API's routes to the app."""
    add = app.add_api_route
    add("/healthz", healthz, methods=["GET"])
    add("/api/rollouts", create_rollouts, methods=["POST"])
    add("/api/rollouts", list_rollouts, methods=["GET"])
    add("/api/rollouts/terminal", terminal_rollouts, methods=["GET"])
    add("/api/rollouts/{rollout_id}", get_rollout, methods=["GET"])
    add("/api/rollouts/{rollout_id}", patch_rollout, methods=["PATCH"])
    add("/api/rollouts/{rollout_id}", delete_rollout, methods=["DELETE"])
    add("/api/rollouts/{rollout_id}/attempts", start_attempt, methods=["POST"])
    add("/api/rollouts/{rollout_id}/attempt/{attempt_id}/evaluator-token", evaluator_token, methods=["POST"])
    add("/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", post_event, methods=["POST"])
    add("/api/rollouts/{rollout_id}/events", list_events, methods=["GET"])
    add("/api/models", register_models, methods=["POST"])
    add("/api/models", delete_models, methods=["DELETE"])
    add("/api/models", list_models, methods=["GET"])
    add("/api/runs", start_run, methods=["POST"])
    add("/api/runs/{run_id}", get_run, methods=["GET"])
