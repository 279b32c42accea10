"""JSON shapes of the rollout API: Agent Lightning 1.0's fields, unchanged, plus Rollwire's.

Agent Lightning's `Rollout` is `{rollout_id, input, is_train, config, metadata, status: {state,
k8s_job_name, last_attempt_id, error_message, version, created_at, updated_at}}` and its `Event`
is `{event_type, rollout_id, attempt_id, timestamp, data}`. Rollwire adds fields beside them
(`run_id`, `group_id`, `mode`, `state`, `attempt_id`, `attempts`, `reward`, ...), never inside.
"""

from __future__ import annotations

from typing import Any

from schemas import CustomEvent, ModelRequestRecorded, RewardReported, to_dict
from schemas.rollout import RolloutView
from services.common.eventstore import StoredEvent

AGL_DEFAULT_CONFIG: dict[str, Any] = {"timeout_seconds": 3600, "local": None, "k8s": None}


def rollout_json(view: RolloutView) -> dict[str, Any]:
    """A rollout as the API returns it (Agent Lightning's `Rollout` plus Rollwire's fields)."""
    current = view.attempt(view.attempt_id) if view.attempt_id else None
    return {
        "rollout_id": view.rollout_id,
        "input": view.input,
        "is_train": view.mode == "train",
        "config": {**AGL_DEFAULT_CONFIG, **view.config},
        "metadata": view.metadata,
        "status": {
            "state": view.status,
            "k8s_job_name": current.executor if current else None,
            "last_attempt_id": view.attempt_id,
            "error_message": view.reason,
            "version": view.version,
            "created_at": view.created_at,
            "updated_at": view.updated_at,
        },
        "run_id": view.run_id,
        "group_id": view.group_id,
        "mode": view.mode,
        "state": view.status,
        "reason": view.reason,
        "attempt_id": view.attempt_id,
        "attempts": [a.attempt_id for a in view.attempts],
        "attempt_count": len(view.attempts),
        "max_attempts": view.max_attempts,
        "reward": view.reward,
        "created_at": view.created_at,
        "updated_at": view.updated_at,
        "cursor": view.created_seq,
    }


def rollout_detail_json(view: RolloutView) -> dict[str, Any]:
    """`GET /api/rollouts/{id}`: the flat rollout, plus Agent Lightning's `{rollout, attempts}` wrapper."""
    flat = rollout_json(view)
    return {**flat, "rollout": dict(flat)}


def _agl_data(stored: StoredEvent) -> tuple[str, dict[str, Any]]:
    """Agent Lightning's `(event_type, data)` for one of our events."""
    event = stored.event
    if isinstance(event, ModelRequestRecorded):
        choice: dict[str, Any] = {
            "index": event.choice_index,
            "token_ids": event.response_ids,
            "logprobs": {"content": [{"logprob": lp} for lp in event.logprobs]} if event.logprobs else None,
            "finish_reason": event.finish_reason,
            **event.response,
        }
        return "model_request", {
            "model": event.model,
            "model_version": event.weights_version,
            "request": event.request,
            "response": {"prompt_token_ids": event.prompt_ids, "choices": [choice], "usage": event.usage},
            "prompt_token_ids": event.prompt_ids,
            "latency_ms": event.latency_s * 1000.0,
            "status": "ok" if event.status == "ok" else "error",
            "usage": event.usage,
            "finish_reason": event.finish_reason,
            "server": {"model": event.model, "version": event.weights_version},
        }
    if isinstance(event, RewardReported):
        return "reward", {"value": event.value, "source": event.source, "name": event.name}
    if isinstance(event, CustomEvent):
        return event.name, dict(event.payload)
    flat = to_dict(event)
    return str(flat["type"]), {k: v for k, v in flat.items() if k not in _ENVELOPE}


_ENVELOPE = frozenset({"type", "event_id", "schema_version", "run_id", "rollout_id", "attempt_id", "time"})


def event_json(stored: StoredEvent, *, agl: bool = True) -> dict[str, Any]:
    """An event as the API returns it: our flat event and its `seq`, plus Agent Lightning's fields."""
    out = to_dict(stored.event)
    out["seq"] = stored.seq
    if agl:
        event_type, data = _agl_data(stored)
        out["event_type"] = event_type
        out["timestamp"] = stored.event.time
        out["data"] = data
        out["attempt_id"] = stored.event.attempt_id or ""
    return out


def triplet_json(stored: StoredEvent) -> dict[str, Any]:
    """Agent Lightning's `format=triplet` trim: token ids and logprobs, or the reward value."""
    out = event_json(stored)
    event = stored.event
    if isinstance(event, ModelRequestRecorded):
        out["data"] = {
            "prompt_token_ids": event.prompt_ids,
            "response_token_ids": event.response_ids,
            "response_log_probs": event.logprobs or None,
            "server": {"model": event.model, "version": event.weights_version},
            "status": "ok" if event.status == "ok" else "error",
        }
    elif isinstance(event, RewardReported):
        out["data"] = {"value": event.value, "source": event.source}
    return out
