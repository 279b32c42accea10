"""Rollout commands: create, change status (checked against the state machine and appended with
the last status event's subject sequence, so two writers never both win), delete, start an
attempt and issue its tokens.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request, Response

from schemas import (
    AttemptStarted,
    RolloutCreated,
    RolloutStatus,
    RolloutStatusChanged,
    check_transition,
    is_terminal,
    new_id,
)
from schemas.ids import ROLLOUT_CREATED
from schemas.rollout import RolloutView, fold_all
from schemas.transitions import IllegalTransition
from services.common.eventstore import Appended, ConcurrencyConflict, StoredEvent
from services.gateway.api import bodies
from services.gateway.api.commands import (
    checked_id,
    event_id_for,
    gateway_of,
    keyed,
    written_view,
)
from services.gateway.api.views import rollout_json
from services.gateway.auth import Admin
from services.gateway.context import Gateway
from services.gateway.errors import ApiError, current_state, invalid
from services.gateway.http import decode, encode, json_response, read_body
from services.gateway.idempotency import Result, derive_id


async def create_rollouts(request: Request) -> Response:
    """`POST /api/rollouts`: a batch (bare list, or `{"rollouts": [...]}`); queues each rollout."""
    gw = gateway_of(request)
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

    return await keyed(request, "admin", body, command)


Prepared = tuple[RolloutCreated, RolloutStatusChanged] | RolloutView
"""A rollout to create (its two events), or one that exists already (its view)."""


async def _create(gw: Gateway, items: list[bodies.NewRollout], key: str | None) -> list[RolloutView]:
    """Append each new rollout's `created` event only if no run has that rollout id yet (JetStream decides,
    so two creates racing in two runs cannot both win), then the `queuing` status of each that won."""
    prepared = [await _prepare(gw, index, item, key) for index, item in enumerate(items)]
    new = [p for p in prepared if isinstance(p, tuple)]
    firsts = await gw.store.append_unique(
        [(created, ROLLOUT_CREATED.format(run="*", rollout=created.rollout_id)) for created, _ in new]
    )
    won = [queued for (_, queued), first in zip(new, firsts, strict=True) if first is not None]
    queued_acks = iter(await gw.store.append_many(won) if won else [])
    created_acks = iter(firsts)
    out: list[RolloutView] = []
    for index, p in enumerate(prepared):
        if isinstance(p, RolloutView):
            out.append(await written_view(gw, p.rollout_id, p.run_id) or p)
            continue
        ack_created = next(created_acks)
        if ack_created is None:
            out.append(await _created_before(gw, index, *p))
        else:
            created, queued = p
            ack_queued = next(queued_acks)
            view = fold_all(
                [
                    StoredEvent(seq=ack_created.seq, subject=created.subject, event=created),
                    StoredEvent(seq=ack_queued.seq, subject=queued.subject, event=queued),
                ]
            )
            assert view is not None  # folded from its own `created` event
            out.append(view)
    return out


async def _created_before(
    gw: Gateway, index: int, created: RolloutCreated, queued: RolloutStatusChanged
) -> RolloutView:
    """A rollout whose id another create took first: it as stored (a repeat of this create, or a create
    of the same rollout in the same run at the same time), or a 409 when that create was in another run."""
    rollout_id = created.rollout_id or ""
    run_id = await gw.state.locate(rollout_id)
    if run_id != created.run_id:
        raise ApiError(
            409, f"rollout id {rollout_id} is already used in run {run_id}", field=f"rollouts[{index}].rollout_id"
        )
    stored = await written_view(gw, rollout_id, run_id)
    if stored is not None and stored.status_seq == 0:  # created, but its queuing status was never written
        await gw.store.append(queued)  # the status's derived id makes a racing repeat a duplicate
        stored = await written_view(gw, rollout_id, run_id)
    assert stored is not None  # its `created` event is on the stream
    return stored


async def _prepare(gw: Gateway, index: int, item: bodies.NewRollout, key: str | None) -> Prepared:
    """The events that create one rollout of a batch, or the rollout when it exists already."""
    if item.input is None:
        raise invalid("a rollout needs an input (not null)", f"rollouts[{index}].input")
    run_id = checked_id(f"rollouts[{index}].run_id", item.run_id or gw.settings.default_run)
    # A key names its rollouts forever (not only within JetStream's duplicate window or this
    # process's cache): a create whose rollout already exists answers it and appends nothing.
    rollout_id = (
        checked_id(f"rollouts[{index}].rollout_id", item.rollout_id)
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
            existing = await written_view(gw, rollout_id, run_id)
            if existing is not None:
                return existing
    else:
        rollout_id = new_id()
    max_attempts = item.max_attempts or gw.state.spec(run_id).max_attempts
    if max_attempts < 1:
        raise invalid("max_attempts must be at least 1", f"rollouts[{index}].max_attempts")
    created = RolloutCreated(
        event_id=derive_id(rollout_id, run_id, "created"),
        run_id=run_id,
        rollout_id=rollout_id,
        input=item.input,
        group_id=item.group_id,
        mode=item.mode or ("val" if item.is_train is False else "train"),
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
    return created, queued


async def patch_rollout(request: Request, rollout_id: str) -> Response:
    """`PATCH /api/rollouts/{id}` (admin): a checked status change."""
    gw = gateway_of(request)
    gw.admin(request)
    checked_id("rollout_id", rollout_id)
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
        checked_id("attempt_id", attempt_id)

    async def command(key: str | None) -> Result:
        view = await gw.rollout_for(Admin(), rollout_id, refresh=True)
        last, seq = await gw.store.last_status(view.run_id, rollout_id)
        event_id = event_id_for(key, "patch", rollout_id)
        if last is None or requested is None or (key and last.event_id == event_id):
            full = await written_view(gw, rollout_id, view.run_id)
            return 200, encode({**rollout_json(full or view), "seq": seq})
        new_attempt = _check_patch(view, last.status, requested, attempt_id)
        changed = RolloutStatusChanged(
            event_id=event_id,
            run_id=view.run_id,
            rollout_id=rollout_id,
            attempt_id=attempt_id or view.attempt_id,
            status=requested,
            previous=last.status,
            reason=reason,
            cause=patch.cause if requested in ("requeuing", "failed") else None,
        )
        ack = await _append_status(gw, changed, seq)
        if new_attempt and attempt_id is not None:
            await _append_attempt(gw, changed, attempt_id, len(view.attempts) + 1, executor)
        gw.state.forget(rollout_id)
        full = await written_view(gw, rollout_id, view.run_id)
        return 200, encode({**rollout_json(full or view), "seq": ack.seq})

    return await keyed(request, "admin", body, command)


def _check_patch(view: RolloutView, status: str | None, requested: RolloutStatus, attempt_id: str | None) -> bool:
    """409 unless the change is allowed for this rollout and attempt; True when it names a new attempt."""
    try:
        check_transition(status, requested)
    except IllegalTransition as exc:
        raise ApiError(409, str(exc), current=current_state(view, status)) from None
    new_attempt = attempt_id is not None and view.attempt(attempt_id) is None
    if attempt_id is not None and not new_attempt and attempt_id != view.attempt_id:
        raise ApiError(
            409,
            f"attempt {attempt_id} is not the rollout's current attempt ({view.attempt_id})",
            current=current_state(view),
        )
    if new_attempt and is_terminal(requested):
        raise ApiError(409, f"rollout {view.rollout_id} has no attempt {attempt_id}", current=current_state(view))
    return new_attempt


async def _append_status(
    gw: Gateway, changed: RolloutStatusChanged, seq: int, current: dict[str, Any] | None = None
) -> Appended:
    """Append a status change after the status event at `seq`; 409 when another writer came first.

    The 409's `current` is the status read again, unless the caller gives it.
    """
    rollout_id = changed.rollout_id or ""
    try:
        return await gw.store.append(changed, expected_last_subject_seq=seq)
    except ConcurrencyConflict:
        gw.state.forget(rollout_id)
        if current is None:
            now, _ = await gw.store.last_status(changed.run_id, rollout_id)
            current = current_state(None, now.status if now else None)
        raise ApiError(
            409, "another writer changed this rollout's status first; read it and decide again", current=current
        ) from None


async def _append_attempt(
    gw: Gateway, after: RolloutStatusChanged, attempt_id: str, sequence: int, executor: str | None
) -> None:
    """The `AttemptStarted` that follows the status change naming a new attempt (its id derived from it)."""
    await gw.store.append(
        AttemptStarted(
            event_id=derive_id(after.event_id, "attempt"),
            run_id=after.run_id,
            rollout_id=after.rollout_id,
            attempt_id=attempt_id,
            sequence=sequence,
            executor=executor,
        )
    )


async def delete_rollout(request: Request, rollout_id: str) -> Response:
    """Agent Lightning's `DELETE /api/rollouts/{id}` (admin): purge the rollout's events. Idempotent."""
    gw = gateway_of(request)
    gw.admin(request)
    checked_id("rollout_id", rollout_id)
    run_id = await gw.state.locate(rollout_id)
    if run_id is not None:
        await gw.store.purge(f"rl.{run_id}.rollout.{rollout_id}.>")
        gw.state.forget(rollout_id)
    return Response(status_code=204)


async def start_attempt(request: Request, rollout_id: str) -> Response:
    """`POST /api/rollouts/{id}/attempts` (admin): a new attempt, its token and URLs."""
    gw = gateway_of(request)
    gw.admin(request)
    checked_id("rollout_id", rollout_id)
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
                current=current_state(view, status),
            )
        if len(view.attempts) >= view.max_attempts:
            raise ApiError(
                409,
                f"rollout {rollout_id} has used all {view.max_attempts} attempts",
                current=current_state(view, status),
            )
        sequence = len(view.attempts) + 1
        preparing = RolloutStatusChanged(
            event_id=event_id_for(key, "preparing", rollout_id),
            run_id=view.run_id,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            status="preparing",
            previous=status,
        )
        ack = await _append_status(gw, preparing, seq, current_state(view, status))
        await _append_attempt(gw, preparing, attempt_id, sequence, new.executor)
        gw.state.forget(rollout_id)
        return 201, encode(_attempt_json(gw, view, attempt_id, sequence, ack.seq))

    return await keyed(request, "admin", body, command)


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
    gw = gateway_of(request)
    gw.admin(request)
    view, _ = await gw.attempt_for(Admin(), checked_id("rollout_id", rollout_id), checked_id("attempt_id", attempt_id))
    token = gw.auth.signer.issue("evaluator", view.run_id, rollout_id, attempt_id)
    return json_response({"token": token, "rollout_id": rollout_id, "attempt_id": attempt_id}, status=201)
