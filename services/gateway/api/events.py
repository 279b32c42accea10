"""Events an attempt reports: a reward or a custom event (`POST .../attempt/{aid}/events`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
from fastapi import Request, Response

from schemas import (
    CustomEvent,
    InvalidId,
    RewardReported,
)
from schemas.events import RESERVED_EVENT_NAMES, EventSource, reserved_event_name
from schemas.ids import CUSTOM_EVENT, REWARD
from services.common.eventstore import StoredEvent
from services.gateway.api import bodies
from services.gateway.api.commands import (
    checked_id,
    event_id_for,
    gateway_of,
    keyed,
)
from services.gateway.api.views import event_json
from services.gateway.auth import AttemptScope
from services.gateway.errors import ended_attempt, forbidden, from_validation, invalid
from services.gateway.http import decode, encode, finite_number, read_body
from services.gateway.idempotency import Recall, Result


async def post_event(request: Request, rollout_id: str, attempt_id: str) -> Response:
    """`POST /api/rollouts/{id}/attempt/{aid}/events`: a reward or a custom event of the attempt."""
    gw = gateway_of(request)
    principal = gw.principal(request)
    checked_id("rollout_id", rollout_id)
    checked_id("attempt_id", attempt_id)
    if isinstance(principal, AttemptScope) and (principal.rollout_id, principal.attempt_id) != (rollout_id, attempt_id):
        raise forbidden(f"this token belongs to rollout {principal.rollout_id} attempt {principal.attempt_id}")
    body = await read_body(request, gw.settings.max_body_bytes)
    parsed = decode(body, bodies.EventBody)
    view, attempt = await gw.attempt_for(principal, rollout_id, attempt_id)
    if isinstance(principal, AttemptScope) and principal.role == "agent" and attempt.ended:
        raise ended_attempt(view, attempt, "its token no longer writes events")
    source = principal.role if isinstance(principal, AttemptScope) else "admin"
    fields = _event_fields(parsed)
    if source == "agent":
        _check_agent_may_post(view.run_id, fields, gw.state.reward_from(view.run_id))

    async def command(key: str | None) -> Result:
        event_id = event_id_for(key, "event", rollout_id, attempt_id)
        event = _new_event(fields, event_id, view.run_id, rollout_id, attempt_id, source)
        if isinstance(event, CustomEvent) and source != "admin":  # counts against the attempt's byte budget
            budget = gw.state.spec(view.run_id).budget
            ack = await gw.budgets.append_event(view, attempt_id, budget, event)
        else:
            ack = await gw.store.append(event)
        return 201, encode(event_json(StoredEvent(seq=ack.seq, subject=event.subject, event=event)))

    def recall(key: str) -> Recall:
        """The event a repeat's first run appended, found by its key-derived id (see `keyed`)."""

        async def find() -> Result | None:
            event_id = event_id_for(key, "event", rollout_id, attempt_id)
            where = {"run": view.run_id, "rollout": rollout_id}
            subject = (
                REWARD.format(**where) if fields.kind == "reward" else CUSTOM_EVENT.format(**where, name=fields.name)
            )
            async for stored in gw.store.read(subject):
                if stored.event.event_id == event_id:
                    return 201, encode(event_json(stored))
            return None

        return find

    return await keyed(request, f"{source}:{rollout_id}:{attempt_id}", body, command, recall)


class _Fields(NamedTuple):
    """What a posted event says, from either of its shapes."""

    kind: str
    name: str | None
    value: float
    payload: dict[str, Any]
    step: int | None


def _check_agent_may_post(run_id: str, fields: _Fields, reward_from: str | None) -> None:
    """403 for what an agent token may not post: a reward where the evaluator reports them, a reserved name."""
    if fields.kind == "reward" and reward_from == "evaluator":
        raise forbidden(f"run {run_id} takes rewards from its evaluator only; an agent token cannot report one")
    if fields.kind == "custom" and reserved_event_name(fields.name or ""):
        raise forbidden(
            f"custom event name {fields.name!r} is reserved (other parts of Rollwire act on it: "
            f"{', '.join(sorted(RESERVED_EVENT_NAMES))} and any name starting with 'flag'); "
            "an agent token cannot write it: choose another name"
        )


def _new_event(
    fields: _Fields, event_id: str, run_id: str, rollout_id: str, attempt_id: str, source: EventSource
) -> RewardReported | CustomEvent:
    """The event to append, or a 422 naming what the contract refuses in it."""
    try:
        if fields.kind == "reward":
            return RewardReported(
                event_id=event_id,
                run_id=run_id,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                value=fields.value,
                name=fields.name,
                step=fields.step,
                source=source,
            )
        return CustomEvent(
            event_id=event_id,
            run_id=run_id,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            name=fields.name or "",
            payload=fields.payload,
            source=source,
        )
    except (InvalidId, msgspec.ValidationError) as exc:
        raise from_validation(exc) from None


def _event_fields(parsed: bodies.EventBody) -> _Fields:
    """(kind, name, value, payload, step) from either event shape; 422 naming what is missing."""
    if parsed.type is None and parsed.event_type is None:
        raise invalid('an event needs "type" ("reward" or "custom") or Agent Lightning\'s "event_type"', "type")
    if parsed.type == "reward" or (parsed.type is None and parsed.event_type == "reward"):
        data = parsed.data or {}
        raw = parsed.value if parsed.value is not None else data.get("value")
        if not finite_number(raw):
            raise invalid('a reward needs a finite number in "value" (one a 64-bit float holds)', "value")
        name = parsed.name or data.get("name")
        return _Fields("reward", name if isinstance(name, str) else None, float(raw), {}, parsed.step)
    if parsed.type == "custom":
        if not parsed.name:
            raise invalid('a custom event needs a "name"', "name")
        return _Fields("custom", parsed.name, 0.0, parsed.payload or {}, None)
    event_type = parsed.event_type or ""
    if event_type == "model_request":
        raise invalid("model_request events are recorded by the proxy; post yours under another name", "event_type")
    return _Fields("custom", event_type, 0.0, parsed.data or {}, None)
