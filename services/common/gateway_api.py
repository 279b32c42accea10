"""The one client of the gateway's admin API: typed methods and one error family.

Used by the controller (attempts, statuses, events), the trainer (runs, rollouts, models, phases)
and the `rollwire` API commands (`SyncGatewayClient`, any path). Every write may carry an
`Idempotency-Key`, so a command retried after a lost answer is applied once. Failures:

- `GatewayUnavailable`: no connection, 5xx or 429: temporary, try again later (a client made with
  `retries` retries a connection error and 502/503/504 itself, with backoff);
- `GatewayConflict` (409): the rollout is not where the caller thought; `current` is its state;
- `GatewayRejected` (other 4xx): permanent for this command; the message is the gateway's.

All are `GatewayError`s, whose message is one line: `METHOD path: status what-the-gateway-said`.
Agents do not use this client: `services.agentkit` keeps its own, free of `services.common`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import msgspec

from services.common.retry import Backoff, RetryableStatus, check_status, retry_async

BACKOFF = Backoff(initial=0.25, maximum=4.0)


class GatewayError(RuntimeError):
    """A call the gateway (or, for the trainer's engine client, the engine) did not carry out."""

    status_code: int | None = None


class GatewayUnavailable(GatewayError):
    """The gateway could not be reached, or answered 5xx or 429; try again later."""


class GatewayConflict(GatewayError):
    """The gateway refused a transition (409): the rollout is not where the caller thought."""

    status_code = 409

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


class NewRollout(msgspec.Struct, frozen=True, kw_only=True):
    """One rollout to declare: its id, task group and input."""

    rollout_id: str
    group_id: str
    input: Any
    metadata: dict[str, Any] = {}
    mode: str = "train"


def error_text(response: httpx.Response) -> str:
    """The gateway's `{"error": ...}` message (or OpenAI's `{"error": {"message"}}`), else the body's start."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().replace("\n", " ")[:200] or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    return str(error) if error else json.dumps(body)[:200]


def unreachable(method: str, url: str, path: str, exc: Exception) -> GatewayUnavailable:
    """The error for a request that got no answer."""
    return GatewayUnavailable(f"{method} {path}: the gateway at {url} cannot be reached ({type(exc).__name__}: {exc})")


def answer(method: str, path: str, response: httpx.Response) -> Any:
    """The decoded JSON answer (None when empty), or the `GatewayError` its status means."""
    if response.status_code >= 400:
        message = f"{method} {path}: {response.status_code} {error_text(response)}"
        if response.status_code == 409:
            try:
                current = response.json().get("current")
            except (ValueError, AttributeError):
                current = None
            raise GatewayConflict(message, current if isinstance(current, dict) else None)
        if response.status_code >= 500 or response.status_code == 429:
            error = GatewayUnavailable(message)
            error.status_code = response.status_code
            raise error
        raise GatewayRejected(message, response.status_code)
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        raise GatewayRejected(f"{method} {path}: the answer is not JSON", response.status_code) from None


class ApiClient:
    """Async JSON calls with a bearer token, idempotency keys and the `GatewayError` family.

    `max_connections` bounds the requests in flight (the rest wait here, not in httpx's pool, whose
    bookkeeping grows with every queued request); `retries` retries transient failures with backoff.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        max_connections: int = 8,
        retries: int = 0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=timeout,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._slots = asyncio.Semaphore(max_connections)
        self.retries = retries
        self.calls: Counter[str] = Counter()
        self.unreachable_at = 0.0
        """Unix time a request last found the gateway unreachable (0: never)."""

    async def close(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        key: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Any:
        """One call (retried when the client retries); the decoded JSON answer, or a `GatewayError`."""
        headers = {"Idempotency-Key": key} if key else {}
        self.calls[f"{method} {path.rsplit('/', 1)[-1] if path.endswith(('attempts', 'events', 'token')) else ''}"] += 1

        async def once() -> httpx.Response:
            async with self._slots:
                response = await self.http.request(method, path, json=body, params=params, headers=headers)
            return check_status(response) if self.retries else response

        try:
            response = await retry_async(
                once, backoff=BACKOFF, transient=(httpx.TransportError, RetryableStatus), retries=self.retries
            )
        except httpx.TransportError as exc:
            self.unreachable_at = time.time()
            raise unreachable(method, self.base_url, path, exc) from None
        except RetryableStatus as exc:
            response = exc.response
        return answer(method, path, response)


class GatewayClient(ApiClient):
    """The gateway's admin API, typed (see the module docstring)."""

    async def _object(self, method: str, path: str, body: Any, key: str | None) -> dict[str, Any]:
        payload = await self.request(method, path, body, key=key)
        return payload if isinstance(payload, dict) else {"result": payload}

    async def healthy(self) -> bool:
        """True when the gateway answers its health check."""
        try:
            response = await self.http.get("/healthz")
        except httpx.TransportError:
            return False
        return response.status_code == 200

    # ---- runs, models, phases (the trainer) ------------------------------------------------------

    async def start_run(self, spec: dict[str, Any]) -> Any:
        """Declare the run and how its rollouts execute (`POST /api/runs`, idempotent per run)."""
        return await self.request("POST", "/api/runs", spec, key=f"run-{spec['run_id']}")

    async def create_rollouts(self, run_id: str, rollouts: Sequence[NewRollout], key: str) -> list[dict[str, Any]]:
        """Queue a batch of rollouts (`POST /api/rollouts`); returns the gateway's rollout records."""
        body = {"rollouts": [{"run_id": run_id, "mode": "train", **msgspec.to_builtins(r)} for r in rollouts]}
        got = await self.request("POST", "/api/rollouts", body, key=key)
        return list(got["rollouts"]) if isinstance(got, dict) else list(got)

    async def register_model(
        self,
        run_id: str,
        name: str,
        base_url: str,
        served_model: str | None,
        weights_version: int | None,
        key: str,
        adapters: dict[str, str] | None = None,
        **rendering: str | None,
    ) -> Any:
        """Point the run's proxy at an inference endpoint (`POST /api/models`); `rendering`: its
        `tokenizer` directory and `reasoning_parser`, for continuous prompt mode; `adapters`: agent ->
        the LoRA adapter its calls are served by."""
        body: dict[str, Any] = {
            "run_id": run_id,
            "name": name,
            "base_url": base_url,
            "served_model": served_model,
            "weights_version": weights_version,
            **{k: v for k, v in rendering.items() if v is not None},
        }
        if adapters:
            body["adapters"] = adapters
        return await self.request("POST", "/api/models", body, key=key)

    async def set_phase(self, run_id: str, phase: str, weights_version: int | None, key: str | None) -> Any:
        """Switch the run's phase: `update` returns once in-flight calls have finished; `rollout` releases."""
        body = {"run_id": run_id, "phase": phase, "weights_version": weights_version}
        return await self.request("POST", "/api/phase", body, key=key)

    async def cancel_rollout(self, rollout_id: str, reason: str) -> Any:
        """Cancel a rollout the run no longer needs (one already ended, a 409, is left as it is)."""
        try:
            return await self.request("PATCH", f"/api/rollouts/{rollout_id}", {"status": "cancelled", "reason": reason})
        except GatewayConflict:
            return None

    # ---- attempts and statuses (the controller) --------------------------------------------------

    async def start_attempt(self, rollout_id: str, executor: str, key: str) -> AttemptGrant:
        """Start the rollout's next attempt (status becomes `preparing`) and get its token and URLs."""
        payload = await self._object("POST", f"/api/rollouts/{rollout_id}/attempts", {"executor": executor}, key)
        return msgspec.convert(payload, AttemptGrant, strict=False)

    async def evaluator_token(self, rollout_id: str, attempt_id: str) -> str:
        """A token for the attempt's evaluator (its rewards count when the run wants them from it)."""
        path = f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/evaluator-token"
        return str((await self._object("POST", path, {}, None))["token"])

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
        payload = await self._object("PATCH", f"/api/rollouts/{rollout_id}", body, key)
        return int(payload.get("seq") or 0)

    async def post_event(self, rollout_id: str, attempt_id: str, body: dict[str, Any], key: str) -> int:
        """Append an event (a custom event, say) to the attempt; returns its stream sequence."""
        payload = await self._object("POST", f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", body, key)
        return int(payload.get("seq") or 0)


class SyncGatewayClient:
    """The same API, synchronous and by path: what a command-line call needs (one request, then exit)."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        key: str | None = None,
    ) -> Any:
        """One request; the decoded JSON answer (None for an empty one), or a `GatewayError`."""
        headers = {"Idempotency-Key": key} if key else {}
        try:
            response = self.client.request(method, path, json=body, params=params, headers=headers)
        except httpx.HTTPError as exc:
            raise unreachable(method, self.url, path, exc) from None
        return answer(method, path, response)
