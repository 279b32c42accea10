"""The rollout API's reads: each answered by the gateway's `RolloutReader` (the projector's query
API, or the stream fold), after the caller's read permission is checked here.
"""

from __future__ import annotations

from typing import Any, get_args

import msgspec
from fastapi import Request, Response

from schemas import (
    AttemptStarted,
    CustomEvent,
    RewardReported,
    RolloutStatus,
    RolloutStatusChanged,
)
from schemas.events import CALL_STARTED_EVENT
from schemas.rollout import RolloutView
from services.common.readside import RolloutQuery
from services.gateway.api.commands import (
    checked_id,
    gateway_of,
    int_param,
)
from services.gateway.api.views import event_json, rollout_detail_json, rollout_json, triplet_json
from services.gateway.auth import AttemptScope, Principal
from services.gateway.context import Gateway
from services.gateway.errors import forbidden, invalid, not_found
from services.gateway.http import json_response


async def _full_view(gw: Gateway, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
    return await gw.reader.get(rollout_id, run_id)


def _may_read(principal: Principal, rollout_id: str) -> None:
    if isinstance(principal, AttemptScope) and principal.rollout_id != rollout_id:
        raise forbidden(f"this token belongs to rollout {principal.rollout_id}; it cannot read {rollout_id}")


def _attempt_reader(principal: Principal, view: RolloutView) -> str | None:
    """For an attempt token: its attempt id, once checked live (an ended attempt's token reads nothing).

    Agents are untrusted: their token reads only their own attempt's events, and only while the
    attempt runs, so an agent cannot learn from other attempts or from rewards judged after it ended.
    """
    if not isinstance(principal, AttemptScope):
        return None
    attempt = view.attempt(principal.attempt_id)
    if attempt is None or attempt.ended:
        raise forbidden(f"attempt {principal.attempt_id} has ended; its token no longer reads this rollout")
    return principal.attempt_id


async def _readable(request: Request, rollout_id: str) -> tuple[Gateway, RolloutView, str | None]:
    """The read-permission check of a rollout's GETs: (gateway, admission view, the attempt a token may read).

    An attempt token reads only its own rollout, and only while its attempt runs (checked on a fresh view).
    """
    gw = gateway_of(request)
    principal = gw.principal(request)
    _may_read(principal, checked_id("rollout_id", rollout_id))
    view = await gw.rollout_for(principal, rollout_id, refresh=isinstance(principal, AttemptScope))
    return gw, view, _attempt_reader(principal, view)


async def get_rollout(request: Request, rollout_id: str) -> Response:
    """`GET /api/rollouts/{id}` (admin, or a token of this rollout)."""
    gw, located, own_attempt = await _readable(request, rollout_id)
    view = await _full_view(gw, rollout_id, located.run_id)
    if view is None:
        raise not_found(f"rollout {rollout_id} does not exist")
    if own_attempt is not None:
        view = msgspec.structs.replace(view, rewards=tuple(r for r in view.rewards if r.attempt_id == own_attempt))
    return json_response(rollout_detail_json(view))


async def list_rollouts(request: Request) -> Response:
    """`GET /api/rollouts?state_in=&status=&run_id=&group_id=&mode=&limit=&cursor=` (admin)."""
    gw = gateway_of(request)
    gw.admin(request)
    params = request.query_params
    statuses = set(params.getlist("state_in")) | set(params.getlist("status"))
    statuses = {s for raw in statuses for s in raw.split(",") if s}
    _check_query(statuses, params.get("mode"))
    run_id = params.get("run_id")
    query = RolloutQuery(
        run_id=checked_id("run_id", run_id) if run_id is not None else None,
        statuses=frozenset(statuses),
        group_id=params.get("group_id"),
        mode=params.get("mode"),
        limit=int_param(request, "limit", 500, 1),
        cursor=int_param(request, "cursor", 0),
    )
    views = await gw.reader.query(query)
    headers = {"x-next-cursor": str(views[-1].created_seq)} if views else {}
    return json_response([rollout_json(v) for v in views], headers=headers)


def _check_query(statuses: set[str], mode: str | None) -> None:
    """422 for a status or mode that does not exist (a typo would otherwise list nothing, silently)."""
    unknown = sorted(statuses - set(get_args(RolloutStatus)))
    if unknown:
        allowed = ", ".join(get_args(RolloutStatus))
        raise invalid(f"unknown status {', '.join(unknown)}; allowed: {allowed}", "state_in")
    if mode is not None and mode not in ("train", "val"):
        raise invalid(f"mode={mode!r}: allowed values are train and val", "mode")


async def terminal_rollouts(request: Request) -> Response:
    """Agent Lightning's `GET /api/rollouts/terminal?after=&limit=` (admin)."""
    gw = gateway_of(request)
    gw.admin(request)
    after = int_param(request, "after", 0)
    limit = int_param(request, "limit", 1000, 1)
    views, total = await gw.reader.terminal(after, limit)
    items = []
    for v in views:
        data_id = v.input.get("data_id") or v.input.get("instance_id") or "" if isinstance(v.input, dict) else ""
        items.append(
            {
                "rollout_id": v.rollout_id,
                "state": v.status,
                "data_id": str(data_id),
                "is_train": v.mode == "train",
                "run_id": v.run_id,
                "group_id": v.group_id,
            }
        )
    return json_response({"items": items, "next_after": after + len(views), "total_terminal": total})


async def list_events(request: Request, rollout_id: str) -> Response:
    """`GET /api/rollouts/{id}/events?type=&event_type=&attempt_id=&format=` (admin, or this rollout's token)."""
    gw, view, own_attempt = await _readable(request, rollout_id)
    stored = await gw.reader.events(rollout_id, view.run_id)
    params = request.query_params
    types = {t for raw in params.getlist("type") for t in raw.split(",") if t}
    fmt = params.get("format")
    attempt = params.get("attempt_id")
    if fmt == "triplet" and attempt is None:
        current = next(
            (
                s.event.attempt_id
                for s in reversed(stored)
                if isinstance(s.event, (RolloutStatusChanged, AttemptStarted)) and s.event.attempt_id
            ),
            None,
        )
        attempt = current
    out = []
    for item in stored:
        event = item.event
        if types:
            if type(event).__struct_config__.tag not in types:
                continue
        elif not isinstance(event, (RewardReported, CustomEvent)) and not _is_call(item):
            continue
        elif isinstance(event, CustomEvent) and event.name == CALL_STARTED_EVENT:
            continue  # the proxy's in-flight markers of streams recorded before they moved to a KV bucket
        if attempt is not None and event.attempt_id != attempt:
            continue
        if own_attempt is not None and event.attempt_id != own_attempt:
            continue
        rendered = triplet_json(item) if fmt == "triplet" else event_json(item)
        if params.get("event_type") and rendered["event_type"] != params.get("event_type"):
            continue
        out.append(rendered)
    return json_response(out)


def _is_call(stored: Any) -> bool:
    return stored.subject.endswith(".model_request")


async def get_run(request: Request, run_id: str) -> Response:
    """`GET /api/runs/{run_id}` (admin): the spec and a count of rollouts by status."""
    gw = gateway_of(request)
    gw.admin(request)
    view = await gw.reader.run(checked_id("run_id", run_id))
    if view is None:
        raise not_found(f"run {run_id} has no events: it was never started (POST /api/runs) nor given a rollout")
    body = {
        "run_id": run_id,
        "name": view.name,
        "spec": view.config,
        "started_at": view.started_at,
        "seq": view.seq,
        "rollouts": view.rollouts,
    }
    summary = await gw.reader.summary(run_id)  # the projection adds reward, tokens, calls
    if summary is not None:
        body["summary"] = msgspec.to_builtins(summary)
    return json_response(body)


async def healthz(request: Request) -> Response:
    """`GET /healthz`: 200 when NATS is connected, the store takes writes and (with a projector) reads
    are answered, else 503 (`degraded`, with the `reason` a full store gave), so probes and
    orchestrators act on it within a second."""
    gw = gateway_of(request)
    connected = gw.store.nc.is_connected
    refusing = gw.store.refusing  # the last append was refused for lack of room, none succeeded since
    body: dict[str, Any] = {"nats": connected}
    if refusing is not None:
        body.update(store="refusing writes", reason=refusing)
    ping = getattr(gw.reader, "ping", None)  # the projector's reader: can reads be answered?
    healthy = connected and refusing is None
    if ping is not None:
        try:
            await ping(1.0)
            body["reads"] = True
        except Exception:
            body["reads"] = healthy = False
    body["status"] = "ok" if healthy else "degraded"
    return json_response(body, 200 if healthy else 503)
