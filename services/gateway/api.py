"""The rollout API: Agent Lightning 1.0's endpoints with their paths and shapes, plus Rollwire's.

Every command becomes events through the event store. A status change is checked against the
rollout's last status event, read fresh, and appended with that event's subject sequence, so two
writers never both win; the loser gets 409 with the current state. Every POST/PATCH honours
`Idempotency-Key` (see `idempotency.py`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, get_args

import msgspec
from fastapi import FastAPI, Request, Response

from schemas import (
    AttemptStarted,
    CustomEvent,
    InvalidId,
    ModelRegistered,
    ModelRemoved,
    RewardReported,
    RolloutCreated,
    RolloutStatus,
    RolloutStatusChanged,
    RunStarted,
    check_id,
    check_transition,
    is_terminal,
    new_id,
)
from schemas.bounds import JSON_INT_MAX
from schemas.ids import RUN_SUBJECT
from schemas.runs import RunSpec
from schemas.transitions import IllegalTransition
from services.common.eventstore import ConcurrencyConflict, StoredEvent
from services.gateway import bodies
from services.gateway.auth import Admin, AttemptScope, Principal
from services.gateway.context import Gateway
from services.gateway.errors import ApiError, forbidden, from_validation, invalid, not_found, unavailable
from services.gateway.http import decode, encode, fingerprint, json_response, read_body
from services.gateway.idempotency import Result, derive_id
from services.gateway.readmodel import RolloutQuery, RolloutView, StreamRolloutReader
from services.gateway.views import event_json, rollout_detail_json, rollout_json, triplet_json

_SLUG = re.compile(r"[^A-Za-z0-9_-]+")


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


def _id(kind: str, value: str) -> str:
    try:
        return check_id(kind, value)
    except InvalidId as exc:
        raise invalid(str(exc), kind) from None


Command = Callable[[str | None], Awaitable[Result]]


async def _keyed(request: Request, scope: str, body: bytes, command: Command) -> Response:
    """Run a command, once per `Idempotency-Key` (repeats get the first response)."""
    if not _gw(request).store.nc.is_connected:
        raise unavailable("the event store (NATS) is unavailable; nothing was changed, retry later")
    key = request.headers.get("idempotency-key")
    if not key:
        status, payload = await command(None)
    else:
        status, payload = await _gw(request).idempotency.run(
            (scope, request.method, request.url.path, key), fingerprint(body), lambda: command(key)
        )
    return Response(payload, status_code=status, media_type="application/json")


def _event_id(key: str | None, *parts: str) -> str:
    return derive_id(key, *parts) if key else new_id()


def _current(view: RolloutView | None, status: str | None = None) -> dict[str, Any]:
    if view is None:
        return {"status": status}
    return {"status": status or view.status, "attempt_id": view.attempt_id, "reason": view.reason}


# ---- rollouts ---------------------------------------------------------------------------------


async def create_rollouts(request: Request) -> Response:
    """`POST /api/rollouts`: a batch (bare list, or `{"rollouts": [...]}`); queues each rollout."""
    gw = _gw(request)
    gw.admin(request)
    body = await read_body(request, gw.settings.max_body_bytes)
    parsed = decode(body, list[bodies.NewRollout] | bodies.RolloutBatch)  # type: ignore[arg-type]
    items = parsed.rollouts if isinstance(parsed, bodies.RolloutBatch) else parsed

    async def command(key: str | None) -> Result:
        views = await _create(gw, items, key)
        last = max((v.status_seq for v in views), default=0)
        if isinstance(parsed, bodies.RolloutBatch):
            return 201, encode({"rollouts": [rollout_json(v) for v in views], "seq": last})
        return 201, encode([{**rollout_json(v), "seq": v.status_seq} for v in views])

    return await _keyed(request, "admin", body, command)


async def _create(gw: Gateway, items: list[bodies.NewRollout], key: str | None) -> list[RolloutView]:
    prepared: list[tuple[RolloutCreated, RolloutStatusChanged] | RolloutView] = []
    for index, item in enumerate(items):
        if item.input is None:
            raise invalid("a rollout needs an input (not null)", f"rollouts[{index}].input")
        run_id = _id(f"rollouts[{index}].run_id", item.run_id or gw.settings.default_run)
        # A key names its rollouts forever (not only within JetStream's duplicate window or this
        # process's cache): a create whose rollout already exists answers it and appends nothing.
        rollout_id = (
            _id(f"rollouts[{index}].rollout_id", item.rollout_id)
            if item.rollout_id is not None
            else (derive_id(key, "rollout", str(index)) if key else None)
        )
        if rollout_id is not None:
            existing_run = await gw.state.locate(rollout_id)
            if existing_run is not None:
                if existing_run != run_id:
                    raise ApiError(
                        409,
                        f"rollout id {rollout_id} is already used in run {existing_run}",
                        field=f"rollouts[{index}].rollout_id",
                    )
                existing = await _written_view(gw, rollout_id, run_id)
                if existing is not None:
                    prepared.append(existing)
                    continue
        else:
            rollout_id = new_id()
        mode = item.mode or ("val" if item.is_train is False else "train")
        spec = gw.state.runs.get(run_id)
        max_attempts = item.max_attempts or (int(spec[0].get("max_attempts", 1)) if spec else 1)
        if max_attempts < 1:
            raise invalid("max_attempts must be at least 1", f"rollouts[{index}].max_attempts")
        created = RolloutCreated(
            event_id=derive_id(rollout_id, run_id, "created"),
            run_id=run_id,
            rollout_id=rollout_id,
            input=item.input,
            group_id=item.group_id,
            mode=mode,
            metadata=item.metadata or {},
            max_attempts=max_attempts,
            config=item.config or {},
        )
        queued = RolloutStatusChanged(
            event_id=derive_id(rollout_id, run_id, "queuing"),
            run_id=run_id,
            rollout_id=rollout_id,
            status="queuing",
            time=created.time,
        )
        prepared.append((created, queued))
    events = [e for p in prepared if isinstance(p, tuple) for e in p]
    acks = await gw.store.append_many(events) if events else []
    out: list[RolloutView] = []
    position = 0
    for p in prepared:
        if isinstance(p, RolloutView):
            out.append(await _written_view(gw, p.rollout_id, p.run_id) or p)
            continue
        created, queued = p
        ack_created, ack_queued = acks[position], acks[position + 1]
        position += 2
        if ack_created.duplicate:  # created concurrently by a retry: answer with what is stored
            stored = await _written_view(gw, created.rollout_id or "", created.run_id)
            if stored is not None:
                out.append(stored)
                continue
        out.append(
            RolloutView(
                rollout_id=created.rollout_id or "",
                run_id=created.run_id,
                input=created.input,
                group_id=created.group_id,
                mode=created.mode,
                metadata=dict(created.metadata),
                config=dict(created.config),
                max_attempts=created.max_attempts,
                status="queuing",
                version=1,
                created_at=created.time,
                updated_at=created.time,
                created_seq=ack_created.seq,
                status_seq=ack_queued.seq,
            )
        )
    return out


async def _full_view(gw: Gateway, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
    return await gw.reader.get(rollout_id, run_id)


async def _written_view(gw: Gateway, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
    """The rollout folded from the stream, for write paths: it shows the write just made (the
    projection may not have applied it yet) and needs no Postgres, so a write never fails on a read."""
    return await StreamRolloutReader(gw.store).get(rollout_id, run_id)


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


async def get_rollout(request: Request, rollout_id: str) -> Response:
    """`GET /api/rollouts/{id}` (admin, or a token of this rollout)."""
    gw = _gw(request)
    principal = gw.principal(request)
    _may_read(principal, _id("rollout_id", rollout_id))
    located = await gw.rollout_for(principal, rollout_id, refresh=isinstance(principal, AttemptScope))
    own_attempt = _attempt_reader(principal, located)
    view = await _full_view(gw, rollout_id, located.run_id)
    if view is None:
        raise not_found(f"rollout {rollout_id} does not exist")
    if own_attempt is not None:
        view = msgspec.structs.replace(view, rewards=[r for r in view.rewards if r.attempt_id == own_attempt])
    return json_response(rollout_detail_json(view))


def _int_param(request: Request, name: str, default: int, minimum: int = 0) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"query parameter {name}={raw!r} is not an integer", name) from None
    if not minimum <= value <= JSON_INT_MAX:
        raise invalid(f"query parameter {name} must be between {minimum} and {JSON_INT_MAX}", name)
    return value


async def list_rollouts(request: Request) -> Response:
    """`GET /api/rollouts?state_in=&status=&run_id=&group_id=&mode=&limit=&cursor=` (admin)."""
    gw = _gw(request)
    gw.admin(request)
    params = request.query_params
    statuses = set(params.getlist("state_in")) | set(params.getlist("status"))
    statuses = {s for raw in statuses for s in raw.split(",") if s}
    _check_query(statuses, params.get("mode"))
    run_id = params.get("run_id")
    query = RolloutQuery(
        run_id=_id("run_id", run_id) if run_id is not None else None,
        statuses=frozenset(statuses),
        group_id=params.get("group_id"),
        mode=params.get("mode"),
        limit=_int_param(request, "limit", 500, 1),
        cursor=_int_param(request, "cursor", 0),
    )
    views = await gw.reader.query(query)
    headers = {"x-next-cursor": str(views[-1].created_seq)} if views else {}
    return json_response([rollout_json(v) for v in views], headers=headers)


def _check_query(statuses: set[str], mode: str | None) -> None:
    """422 for a status or mode that does not exist (a typo would otherwise list nothing, silently)."""
    unknown = sorted(statuses - set(get_args(RolloutStatus)))
    if unknown:
        raise invalid(f"unknown status {', '.join(unknown)}; allowed: {', '.join(get_args(RolloutStatus))}", "state_in")
    if mode is not None and mode not in ("train", "val"):
        raise invalid(f"mode={mode!r}: allowed values are train and val", "mode")


async def terminal_rollouts(request: Request) -> Response:
    """Agent Lightning's `GET /api/rollouts/terminal?after=&limit=` (admin)."""
    gw = _gw(request)
    gw.admin(request)
    after = _int_param(request, "after", 0)
    limit = _int_param(request, "limit", 1000, 1)
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


async def patch_rollout(request: Request, rollout_id: str) -> Response:
    """`PATCH /api/rollouts/{id}` (admin): a checked status change."""
    gw = _gw(request)
    gw.admin(request)
    _id("rollout_id", rollout_id)
    body = await read_body(request, gw.settings.max_body_bytes)
    patch = decode(body, bodies.RolloutPatch)
    if isinstance(patch.status, bodies.AglStatusPatch):
        requested = patch.status.state
        attempt_id = patch.status.last_attempt_id or patch.attempt_id
        reason = patch.status.error_message or patch.reason
        executor = patch.status.k8s_job_name
    else:
        requested, attempt_id, reason, executor = patch.status, patch.attempt_id, patch.reason, None
    if attempt_id is not None:
        _id("attempt_id", attempt_id)

    async def command(key: str | None) -> Result:
        view = await gw.rollout_for(Admin(), rollout_id, refresh=True)
        last, seq = await gw.store.last_status(view.run_id, rollout_id)
        event_id = _event_id(key, "patch", rollout_id)
        if last is None or requested is None or (key and last.event_id == event_id):
            full = await _written_view(gw, rollout_id, view.run_id)
            return 200, encode({**rollout_json(full or view), "seq": seq})
        try:
            check_transition(last.status, requested)
        except IllegalTransition as exc:
            raise ApiError(409, str(exc), current=_current(view, last.status)) from None
        new_attempt = attempt_id is not None and view.attempt(attempt_id) is None
        if attempt_id is not None and not new_attempt and attempt_id != view.attempt_id:
            raise ApiError(
                409,
                f"attempt {attempt_id} is not the rollout's current attempt ({view.attempt_id})",
                current=_current(view),
            )
        if new_attempt and is_terminal(requested):
            raise ApiError(409, f"rollout {rollout_id} has no attempt {attempt_id}", current=_current(view))
        changed = RolloutStatusChanged(
            event_id=event_id,
            run_id=view.run_id,
            rollout_id=rollout_id,
            attempt_id=attempt_id or view.attempt_id,
            status=requested,
            previous=last.status,
            reason=reason,
        )
        try:
            ack = await gw.store.append(changed, expected_last_subject_seq=seq)
        except ConcurrencyConflict:
            gw.state.forget(rollout_id)
            now, _ = await gw.store.last_status(view.run_id, rollout_id)
            raise ApiError(
                409,
                "another writer changed this rollout's status first; read it and decide again",
                current=_current(None, now.status if now else None),
            ) from None
        if new_attempt and attempt_id is not None:
            await gw.store.append(
                AttemptStarted(
                    event_id=derive_id(changed.event_id, "attempt"),
                    run_id=view.run_id,
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                    sequence=len(view.attempts) + 1,
                    executor=executor,
                )
            )
        gw.state.forget(rollout_id)
        full = await _written_view(gw, rollout_id, view.run_id)
        return 200, encode({**rollout_json(full or view), "seq": ack.seq})

    return await _keyed(request, "admin", body, command)


async def delete_rollout(request: Request, rollout_id: str) -> Response:
    """Agent Lightning's `DELETE /api/rollouts/{id}` (admin): purge the rollout's events. Idempotent."""
    gw = _gw(request)
    gw.admin(request)
    _id("rollout_id", rollout_id)
    run_id = await gw.state.locate(rollout_id)
    if run_id is not None:
        await gw.store.purge(f"rl.{run_id}.rollout.{rollout_id}.>")
        gw.state.forget(rollout_id)
    return Response(status_code=204)


# ---- attempts and tokens -------------------------------------------------------------------


async def start_attempt(request: Request, rollout_id: str) -> Response:
    """`POST /api/rollouts/{id}/attempts` (admin): a new attempt, its token and URLs."""
    gw = _gw(request)
    gw.admin(request)
    _id("rollout_id", rollout_id)
    body = await read_body(request, gw.settings.max_body_bytes)
    new = decode(body, bodies.NewAttempt, empty=bodies.NewAttempt())

    async def command(key: str | None) -> Result:
        view = await gw.rollout_for(Admin(), rollout_id, refresh=True)
        last, seq = await gw.store.last_status(view.run_id, rollout_id)
        attempt_id = "a" + derive_id(key, "attempt", rollout_id, length=24) if key else new_id("a")
        if key and last is not None and last.attempt_id == attempt_id and view.attempt(attempt_id):
            return 201, encode(_attempt_json(gw, view, attempt_id, view.attempt(attempt_id).sequence, seq))  # type: ignore[union-attr]
        status = last.status if last else None
        if status not in ("queuing", "requeuing"):
            raise ApiError(
                409,
                f"rollout {rollout_id} is {status}; a new attempt can start only from queuing or requeuing",
                current=_current(view, status),
            )
        if len(view.attempts) >= view.max_attempts:
            raise ApiError(
                409, f"rollout {rollout_id} has used all {view.max_attempts} attempts", current=_current(view, status)
            )
        sequence = len(view.attempts) + 1
        preparing = RolloutStatusChanged(
            event_id=_event_id(key, "preparing", rollout_id),
            run_id=view.run_id,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            status="preparing",
            previous=status,
        )
        try:
            ack = await gw.store.append(preparing, expected_last_subject_seq=seq)
        except ConcurrencyConflict:
            gw.state.forget(rollout_id)
            raise ApiError(
                409,
                "another writer changed this rollout's status first; read it and decide again",
                current=_current(view, status),
            ) from None
        await gw.store.append(
            AttemptStarted(
                event_id=derive_id(preparing.event_id, "attempt"),
                run_id=view.run_id,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                sequence=sequence,
                executor=new.executor,
            )
        )
        gw.state.forget(rollout_id)
        return 201, encode(_attempt_json(gw, view, attempt_id, sequence, ack.seq))

    return await _keyed(request, "admin", body, command)


def _attempt_json(gw: Gateway, view: RolloutView, attempt_id: str, sequence: int, seq: int) -> dict[str, Any]:
    base = gw.settings.base_url
    rid = view.rollout_id
    proxy = f"{base}/proxy/rollout/{rid}/attempt/{attempt_id}/mode/{view.mode}"
    return {
        "rollout_id": rid,
        "run_id": view.run_id,
        "attempt_id": attempt_id,
        "sequence": sequence,
        "token": gw.auth.signer.issue("agent", view.run_id, rid, attempt_id),
        "proxy_base_url": f"{proxy}/openai/v1",
        "anthropic_base_url": f"{proxy}/anthropic",
        "events_url": f"{base}/api/rollouts/{rid}/attempt/{attempt_id}/events",
        "seq": seq,
    }


async def evaluator_token(request: Request, rollout_id: str, attempt_id: str) -> Response:
    """`POST /api/rollouts/{id}/attempt/{aid}/evaluator-token` (admin)."""
    gw = _gw(request)
    gw.admin(request)
    view = await gw.rollout_for(Admin(), _id("rollout_id", rollout_id))
    if view.attempt(_id("attempt_id", attempt_id)) is None:
        view = await gw.rollout_for(Admin(), rollout_id, refresh=True)
        if view.attempt(attempt_id) is None:
            raise not_found(f"rollout {rollout_id} has no attempt {attempt_id}")
    token = gw.auth.signer.issue("evaluator", view.run_id, rollout_id, attempt_id)
    return json_response({"token": token, "rollout_id": rollout_id, "attempt_id": attempt_id}, status=201)


# ---- events ---------------------------------------------------------------------------------


async def post_event(request: Request, rollout_id: str, attempt_id: str) -> Response:
    """`POST /api/rollouts/{id}/attempt/{aid}/events`: a reward or a custom event of the attempt."""
    gw = _gw(request)
    principal = gw.principal(request)
    _id("rollout_id", rollout_id)
    _id("attempt_id", attempt_id)
    if isinstance(principal, AttemptScope) and (principal.rollout_id, principal.attempt_id) != (rollout_id, attempt_id):
        raise forbidden(f"this token belongs to rollout {principal.rollout_id} attempt {principal.attempt_id}")
    body = await read_body(request, gw.settings.max_body_bytes)
    parsed = decode(body, bodies.EventBody)
    view = await gw.rollout_for(principal, rollout_id)
    attempt = view.attempt(attempt_id)
    if attempt is None:
        view = await gw.rollout_for(principal, rollout_id, refresh=True)
        attempt = view.attempt(attempt_id)
        if attempt is None:
            raise not_found(f"rollout {rollout_id} has no attempt {attempt_id}")
    if isinstance(principal, AttemptScope) and principal.role == "agent" and attempt.ended:
        raise ApiError(
            409, f"attempt {attempt_id} has ended; its token no longer writes events", current=_current(view)
        )
    source = principal.role if isinstance(principal, AttemptScope) else "admin"
    kind, name, value, payload, step = _event_fields(parsed)
    if kind == "reward" and source == "agent" and gw.state.reward_from(view.run_id) == "evaluator":
        raise forbidden(f"run {view.run_id} takes rewards from its evaluator only; an agent token cannot report one")

    async def command(key: str | None) -> Result:
        event_id = _event_id(key, "event", rollout_id, attempt_id)
        event: RewardReported | CustomEvent
        try:
            if kind == "reward":
                event = RewardReported(
                    event_id=event_id,
                    run_id=view.run_id,
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                    value=value,
                    name=name,
                    step=step,
                    source=source,
                )  # type: ignore[arg-type]
            else:
                event = CustomEvent(
                    event_id=event_id,
                    run_id=view.run_id,
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                    name=name or "",
                    payload=payload,
                )
        except (InvalidId, msgspec.ValidationError) as exc:
            raise from_validation(exc) from None
        ack = await gw.store.append(event)
        return 201, encode(event_json(StoredEvent(seq=ack.seq, subject=event.subject, event=event)))

    return await _keyed(request, f"{source}:{rollout_id}:{attempt_id}", body, command)


def _event_fields(parsed: bodies.EventBody) -> tuple[str, str | None, float, dict[str, Any], int | None]:
    """(kind, name, value, payload, step) from either event shape; 422 naming what is missing."""
    if parsed.type is None and parsed.event_type is None:
        raise invalid('an event needs "type" ("reward" or "custom") or Agent Lightning\'s "event_type"', "type")
    if parsed.type == "reward" or (parsed.type is None and parsed.event_type == "reward"):
        data = parsed.data or {}
        raw = parsed.value if parsed.value is not None else data.get("value")
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
            raise invalid('a reward needs a finite number in "value"', "value")
        name = parsed.name or data.get("name")
        return "reward", name if isinstance(name, str) else None, float(raw), {}, parsed.step
    if parsed.type == "custom":
        if not parsed.name:
            raise invalid('a custom event needs a "name"', "name")
        return "custom", parsed.name, 0.0, parsed.payload or {}, None
    event_type = parsed.event_type or ""
    if event_type == "model_request":
        raise invalid("model_request events are recorded by the proxy; post yours under another name", "event_type")
    return "custom", event_type, 0.0, parsed.data or {}, None


async def list_events(request: Request, rollout_id: str) -> Response:
    """`GET /api/rollouts/{id}/events?type=&event_type=&attempt_id=&format=` (admin, or this rollout's token)."""
    gw = _gw(request)
    principal = gw.principal(request)
    _may_read(principal, _id("rollout_id", rollout_id))
    view = await gw.rollout_for(principal, rollout_id, refresh=isinstance(principal, AttemptScope))
    own_attempt = _attempt_reader(principal, view)
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


# ---- models, runs, health -----------------------------------------------------------------


async def register_models(request: Request) -> Response:
    """`POST /api/models` (admin): Agent Lightning's `[{model, endpoint, version}]` or `{name, base_url, ...}`."""
    gw = _gw(request)
    gw.admin(request)
    body = await read_body(request, gw.settings.max_body_bytes)
    parsed = decode(body, list[bodies.AglModel] | bodies.ModelBody)  # type: ignore[arg-type]

    async def command(key: str | None) -> Result:
        if isinstance(parsed, bodies.ModelBody):
            run_id = _id("run_id", parsed.run_id or gw.settings.default_run)
            try:
                event = ModelRegistered(
                    event_id=_event_id(key, "model", run_id, parsed.name),
                    run_id=run_id,
                    name=parsed.name,
                    base_url=parsed.base_url,
                    served_model=parsed.served_model,
                    weights_version=parsed.weights_version,
                    api_key=parsed.api_key,
                )
            except (InvalidId, msgspec.ValidationError) as exc:
                raise from_validation(exc) from None
            ack = await gw.append_registry(event)
            return 201, encode(
                {
                    "name": event.name,
                    "base_url": event.base_url,
                    "run_id": run_id,
                    "served_model": event.served_model,
                    "weights_version": event.weights_version,
                    "seq": ack.seq,
                }
            )
        out = []
        for index, model in enumerate(parsed):
            name = _agl_model_name(model.model, model.endpoint)
            event = ModelRegistered(
                event_id=_event_id(key, "model", str(index)),
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

    return await _keyed(request, "admin", body, command)


def _agl_model_name(model: str, endpoint: str) -> str:
    """A subject-safe registry name for Agent Lightning's (model, endpoint) key."""
    slug = _SLUG.sub("_", model).strip("_")[:80] or "model"
    return f"{slug}-{derive_id(model, endpoint, length=10)}"


async def list_models(request: Request) -> Response:
    """`GET /api/models?run_id=` (admin): the registered endpoints (their `api_key` left out)."""
    gw = _gw(request)
    gw.admin(request)
    run_id = request.query_params.get("run_id")
    models = [
        {"name": m.name, "run_id": run, "base_url": m.base_url, "served_model": m.upstream_model,
         "weights_version": m.weights_version, "has_api_key": m.api_key is not None, "seq": m.seq}
        for (run, _), m in sorted(gw.state.models.items())
        if run_id is None or run == run_id
    ]  # fmt: skip
    return json_response({"models": models})


async def delete_models(request: Request) -> Response:
    """`DELETE /api/models?name=&run_id=` (admin); without `name`, every model (Agent Lightning's shape)."""
    gw = _gw(request)
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
    gw = _gw(request)
    gw.admin(request)
    body = await read_body(request, gw.settings.max_body_bytes)
    spec = decode(body, RunSpec)
    config = msgspec.to_builtins(spec)

    async def command(key: str | None) -> Result:
        existing = await gw.store.last(RUN_SUBJECT.format(run=spec.run_id))  # the stream: no Postgres for a write
        if existing is not None and isinstance(existing.event, RunStarted):
            if _same_spec(existing.event.config) != config:
                raise ApiError(
                    409,
                    f"run {spec.run_id} was already started with a different spec; a run's spec never changes: "
                    "resume it with the same settings, or start a new run id",
                    current=existing.event.config,
                )
            return 200, encode({"run_id": spec.run_id, "spec": existing.event.config, "seq": existing.seq})
        event = RunStarted(event_id=derive_id(spec.run_id, "run"), run_id=spec.run_id, name=spec.name, config=config)
        try:
            ack = await gw.append_registry(event, expected_last_subject_seq=0)
        except ConcurrencyConflict:
            raise ApiError(
                409, f"run {spec.run_id} was started concurrently; read it with GET /api/runs/{spec.run_id}"
            ) from None
        return 201, encode({"run_id": spec.run_id, "spec": config, "seq": ack.seq})

    return await _keyed(request, "admin", body, command)


def _same_spec(config: dict[str, Any]) -> dict[str, Any]:
    """A stored spec with the fields added since it was written at their defaults (so it compares equal)."""
    try:
        return msgspec.to_builtins(msgspec.convert(config, RunSpec))  # type: ignore[no-any-return]
    except (msgspec.ValidationError, InvalidId):
        return config


async def get_run(request: Request, run_id: str) -> Response:
    """`GET /api/runs/{run_id}` (admin): the spec and a count of rollouts by status."""
    gw = _gw(request)
    gw.admin(request)
    view = await gw.reader.run(_id("run_id", run_id))
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
    summarize = getattr(gw.reader, "summary", None)  # the Postgres reader adds reward, tokens, calls
    if summarize is not None:
        body["summary"] = msgspec.to_builtins(await summarize(run_id))
    return json_response(body)


async def healthz(request: Request) -> Response:
    """`GET /healthz`: 200 when NATS is connected and (with the Postgres reader) reads are answered,
    else 503 (`degraded`), so probes and orchestrators act on it within a second."""
    gw = _gw(request)
    connected = gw.store.nc.is_connected
    body: dict[str, Any] = {"nats": connected}
    ping = getattr(gw.reader, "ping", None)  # the Postgres reader: can reads be answered?
    healthy = connected
    if ping is not None:
        try:
            await ping(1.0)
            body["reads"] = True
        except Exception:
            body["reads"] = healthy = False
    body["status"] = "ok" if healthy else "degraded"
    return json_response(body, 200 if healthy else 503)


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
