"""The gateway's shared parts, made once at start and handed to the routes and the proxy."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from schemas import Event
from schemas.rollout import AttemptView, RolloutView
from services.common.eventstore import Appended, EventStore, StoredEvent
from services.common.readside import RolloutReader
from services.gateway.auth import Admin, AttemptScope, Authenticator, Principal
from services.gateway.errors import forbidden, not_found, unauthorized
from services.gateway.idempotency import IdempotencyCache
from services.gateway.phase import PhaseGate
from services.gateway.phasesync import PhaseSync
from services.gateway.proxy.budgets import Budgets
from services.gateway.proxy.reaper import CallReaper
from services.gateway.proxy.recording import CallChains
from services.gateway.proxy.upstream import UpstreamClient
from services.gateway.settings import GatewaySettings
from services.gateway.state import GatewayState


@dataclass
class Gateway:
    """Settings, event store, caches, reader, phase gate and the upstream HTTP client."""

    settings: GatewaySettings
    store: EventStore
    state: GatewayState
    reader: RolloutReader
    auth: Authenticator
    idempotency: IdempotencyCache
    gate: PhaseGate
    upstream: UpstreamClient
    budgets: Budgets
    chains: CallChains = field(default_factory=CallChains)
    reaper: CallReaper | None = None
    phases: PhaseSync | None = None

    def principal(self, request: Request) -> Principal:
        """The caller, or 401 when no valid token is presented."""
        headers = request.headers
        principal = self.auth.principal(headers.get("authorization"), headers.get("x-api-key"))
        if principal is None:
            raise unauthorized()
        return principal

    def admin(self, request: Request) -> Admin:
        """The caller, who must hold the admin token (403 for an attempt token)."""
        principal = self.principal(request)
        if not isinstance(principal, Admin):
            raise forbidden("this endpoint needs the admin token; an attempt token cannot use it")
        return principal

    async def rollout_for(self, principal: Principal, rollout_id: str, *, refresh: bool = False) -> RolloutView:
        """The admission view of a rollout the principal may act on (403 foreign, 404 unknown)."""
        if isinstance(principal, AttemptScope) and principal.rollout_id != rollout_id:
            raise forbidden(f"this token belongs to rollout {principal.rollout_id}, not {rollout_id}")
        run_hint = principal.run_id if isinstance(principal, AttemptScope) else None
        view = await self.state.rollout(rollout_id, run_hint, refresh=refresh)
        if view is None:
            raise not_found(f"rollout {rollout_id} does not exist")
        return view

    async def attempt_for(
        self, principal: Principal, rollout_id: str, attempt_id: str
    ) -> tuple[RolloutView, AttemptView]:
        """The rollout and one of its attempts (read again once when the cache does not know it yet; 404 if none)."""
        view = await self.rollout_for(principal, rollout_id)
        attempt = view.attempt(attempt_id)
        if attempt is None:
            view = await self.rollout_for(principal, rollout_id, refresh=True)
            attempt = view.attempt(attempt_id)
            if attempt is None:
                raise not_found(f"rollout {rollout_id} has no attempt {attempt_id}")
        return view, attempt

    async def append_registry(self, event: Event, expected_last_subject_seq: int | None = None) -> Appended:
        """Append a model, phase or run event and let the registries see it at once."""
        appended = await self.store.append(event, expected_last_subject_seq)
        self.state.apply(StoredEvent(seq=appended.seq, subject=event.subject, event=event))  # type: ignore[arg-type]
        return appended
