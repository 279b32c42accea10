"""What every route of the rollout API shares: the gateway of a request, checked ids, idempotent
commands (`Idempotency-Key`), event ids, the `current` of a 409, and the rollout as just written.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from schemas import (
    InvalidId,
    check_id,
    new_id,
)
from schemas.rollout import RolloutView
from services.common.query import int_query
from services.common.readside import StreamRolloutReader
from services.gateway.context import Gateway
from services.gateway.errors import invalid, unavailable
from services.gateway.http import fingerprint
from services.gateway.idempotency import Recall, Result, derive_id


def gateway_of(request: Request) -> Gateway:
    """The gateway a request reached (its services, settings and caches)."""
    return request.app.state.gateway


def checked_id(kind: str, value: str) -> str:
    """`value` if it is a valid id, else a 422 naming `kind`."""
    try:
        return check_id(kind, value)
    except InvalidId as exc:
        raise invalid(str(exc), kind) from None


Command = Callable[[str | None], Awaitable[Result]]


async def keyed(
    request: Request, scope: str, body: bytes, command: Command, recall: Callable[[str], Recall] | None = None
) -> Response:
    """Run a command, once per `Idempotency-Key` (repeats get the first response; `recall(key)` finds
    what a repeat's first run wrote when this process has no answer for it, see `IdempotencyCache.run`)."""
    if not gateway_of(request).store.nc.is_connected:
        raise unavailable("the event store (NATS) is unavailable; nothing was changed, retry later")
    key = request.headers.get("idempotency-key")
    if not key:
        status, payload = await command(None)
    else:
        status, payload = await gateway_of(request).idempotency.run(
            (scope, request.method, request.url.path, key),
            fingerprint(body),
            lambda: command(key),
            recall(key) if recall is not None else None,
        )
    return Response(payload, status_code=status, media_type="application/json")


def event_id_for(key: str | None, *parts: str) -> str:
    """The event id of a command: derived from its idempotency key (a retry appends a duplicate), else new."""
    return derive_id(key, *parts) if key else new_id()


async def written_view(gw: Gateway, rollout_id: str, run_id: str | None = None) -> RolloutView | None:
    """The rollout folded from the stream, for write paths: it shows the write just made (the
    projection may not have applied it yet) and needs no Postgres, so a write never fails on a read."""
    return await StreamRolloutReader(gw.store).get(rollout_id, run_id)


def int_param(request: Request, name: str, default: int, minimum: int = 0) -> int:
    """An integer query parameter in [minimum, PAGE_MAX] (`default` when absent); a 422 naming it otherwise."""
    try:
        return int_query(request.query_params.get(name), name, default, minimum)
    except ValueError as exc:
        raise invalid(str(exc), name) from None
