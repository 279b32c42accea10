"""The controller's commands, sent through the gateway's HTTP API with the admin token.

All writes go through the gateway so that every status change is checked against the rollout's
state machine in one place. Every command carries a deterministic `Idempotency-Key`, so a command
retried after a lost response is a duplicate, not a second change. Failures are sorted the way
the reconcile loop handles them:

- `GatewayUnavailable` (no connection, 5xx, 503): temporary, retry later;
- `GatewayConflict` (409): the rollout moved on; re-read it and decide again;
- `GatewayRejected` (other 4xx): permanent for this command; the message says why.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx
import msgspec


class GatewayError(RuntimeError):
    """A command the gateway did not carry out."""


class GatewayUnavailable(GatewayError):
    """The gateway could not be reached or answered 5xx; retry later."""


class GatewayConflict(GatewayError):
    """The gateway refused a transition (409): the rollout is not where the controller thought."""

    def __init__(self, message: str, current: dict[str, Any] | None) -> None:
        super().__init__(message)
        self.current = current or {}


class GatewayRejected(GatewayError):
    """The gateway refused the command for good (4xx other than 409); the message is its error."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class AttemptGrant(msgspec.Struct, frozen=True, kw_only=True):
    """The gateway's answer to starting an attempt: what its execution needs to know."""

    attempt_id: str
    token: str
    proxy_base_url: str
    events_url: str
    anthropic_base_url: str = ""
    sequence: int = 0
    seq: int = 0


class GatewayClient:
    """Admin calls the controller makes (see the module docstring)."""

    def __init__(self, base_url: str, admin_token: str, *, timeout: float = 30.0, max_connections: int = 8) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        # Requests wait here, not in httpx's pool: its bookkeeping grows with every queued request.
        self._slots = asyncio.Semaphore(max_connections)
        self.calls: Counter[str] = Counter()
        self.unreachable_at = 0.0
        """Unix time a request last found the gateway unreachable (0: never): an agent that failed then
        may have failed because of it (`Launcher` classifies its failure as `infrastructure`)."""

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def _request(self, method: str, path: str, body: dict[str, Any] | None, key: str | None) -> dict[str, Any]:
        headers = {"Idempotency-Key": key} if key else {}
        self.calls[f"{method} {path.rsplit('/', 1)[-1] if path.endswith(('attempts', 'events', 'token')) else ''}"] += 1
        try:
            async with self._slots:
                response = await self._client.request(method, path, json=body, headers=headers)
        except httpx.TransportError as exc:
            self.unreachable_at = time.time()
            raise GatewayUnavailable(f"{method} {self.base_url}{path}: {exc!r}") from None
        try:
            payload = response.json() if response.content else {}
        except ValueError:
            payload = {"error": response.text[:500]}
        if not isinstance(payload, dict):
            payload = {"result": payload}
        if response.status_code < 400:
            return payload
        message = f"{method} {path}: {response.status_code} {payload.get('error', payload)}"
        if response.status_code == 409:
            current = payload.get("current")
            raise GatewayConflict(message, current if isinstance(current, dict) else None)
        if response.status_code >= 500 or response.status_code == 429:
            raise GatewayUnavailable(message)
        raise GatewayRejected(message, response.status_code)

    async def healthy(self) -> bool:
        """True when the gateway answers its health check."""
        try:
            response = await self._client.get("/healthz")
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def start_attempt(self, rollout_id: str, executor: str, key: str) -> AttemptGrant:
        """Start the rollout's next attempt (status becomes `preparing`) and get its token and URLs."""
        payload = await self._request("POST", f"/api/rollouts/{rollout_id}/attempts", {"executor": executor}, key)
        return msgspec.convert(payload, AttemptGrant, strict=False)

    async def evaluator_token(self, rollout_id: str, attempt_id: str) -> str:
        """A token for the attempt's evaluator (its rewards count when the run wants them from it)."""
        payload = await self._request(
            "POST", f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/evaluator-token", {}, None
        )
        return str(payload["token"])

    async def set_status(
        self,
        rollout_id: str,
        status: str,
        *,
        attempt_id: str | None,
        reason: str | None,
        key: str,
        cause: str | None = None,
    ) -> int:
        """Move the rollout to `status` (checked by the gateway); returns the status event's stream sequence.

        `cause` (on `requeuing` and `failed`) is the failure's classification the trainer reads."""
        body: dict[str, Any] = {"status": status}
        if attempt_id is not None:
            body["attempt_id"] = attempt_id
        if reason is not None:
            body["reason"] = reason
        if cause is not None:
            body["cause"] = cause
        payload = await self._request("PATCH", f"/api/rollouts/{rollout_id}", body, key)
        return int(payload.get("seq") or 0)

    async def post_event(self, rollout_id: str, attempt_id: str, body: dict[str, Any], key: str) -> int:
        """Append an event (a custom event, say) to the attempt; returns its stream sequence."""
        payload = await self._request("POST", f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", body, key)
        return int(payload.get("seq") or 0)
