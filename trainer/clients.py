"""The trainer's HTTP calls: the gateway's admin API and the engine's reload.

Every write carries an `Idempotency-Key` derived from what it does (run, step, phase), so a call
retried after a timeout, or repeated by a resumed run, is applied once. Transient failures (a
connection error, 502/503/504) are retried with backoff; anything else is a `GatewayError`
carrying the gateway's own message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from services.common.retry import Backoff, RetryableStatus, check_status, retry_async

BACKOFF = Backoff(initial=0.25, maximum=4.0)


@dataclass(frozen=True)
class ServiceUrls:
    """Where the services the trainer talks to are."""

    gateway_url: str
    nats_url: str
    engine_url: str
    admin_token: str
    engine_urls: tuple[str, ...] = ()  # the stack's vLLM replicas (`/v1` each), when it started them
    engine_api_key: str = ""  # what those replicas require on every route

    @property
    def engine_base(self) -> str:
        """The engine's root URL (its OpenAI routes are under `/v1`)."""
        return self.engine_url.rstrip("/").removesuffix("/v1")


class GatewayError(RuntimeError):
    """The gateway or the engine refused a call; the message is theirs."""


class NewRollout(msgspec.Struct, frozen=True, kw_only=True):
    """One rollout to declare: its id, task group and input."""

    rollout_id: str
    group_id: str
    input: Any
    metadata: dict[str, Any] = {}
    mode: str = "train"


def _error(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    return str(body.get("error", body)) if isinstance(body, dict) else str(body)[:300]


class HttpClient:
    """A small JSON client with retries and idempotency keys, shared by the two APIs below."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    async def request(
        self, method: str, path: str, body: Any = None, *, key: str | None = None, retries: int = 6
    ) -> Any:
        """Send one call, retrying transient failures; returns the decoded JSON body."""
        headers = {"Idempotency-Key": key} if key else {}

        async def once() -> httpx.Response:
            return check_status(await self.http.request(method, path, json=body, headers=headers))

        try:
            response = await retry_async(
                once, backoff=BACKOFF, transient=(httpx.TransportError, RetryableStatus), retries=retries
            )
        except httpx.TransportError as exc:
            raise GatewayError(f"{method} {self.base_url}{path} failed: {exc}") from None
        except RetryableStatus as exc:
            response = exc.response
        if response.status_code >= 400:
            raise GatewayError(f"{method} {path}: {response.status_code} {_error(response)}")
        return response.json() if response.content else None

    async def close(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()


class GatewayClient(HttpClient):
    """The admin calls the trainer makes (see the gateway's HTTP contract)."""

    async def start_run(self, spec: dict[str, Any]) -> Any:
        """Declare the run and how its rollouts execute (`POST /api/runs`, idempotent per run)."""
        return await self.request("POST", "/api/runs", spec, key=f"run-{spec['run_id']}")

    async def create_rollouts(self, run_id: str, rollouts: Sequence[NewRollout], key: str) -> list[dict[str, Any]]:
        """Queue a batch of rollouts (`POST /api/rollouts`); returns the gateway's rollout records."""
        body = {"rollouts": [{"run_id": run_id, "mode": "train", **msgspec.to_builtins(r)} for r in rollouts]}
        answer = await self.request("POST", "/api/rollouts", body, key=key)
        return list(answer["rollouts"]) if isinstance(answer, dict) else list(answer)

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
        """Cancel a rollout the run no longer needs (a 409 for one already ended is ignored)."""
        try:
            return await self.request("PATCH", f"/api/rollouts/{rollout_id}", {"status": "cancelled", "reason": reason})
        except GatewayError as exc:
            if " 409 " in str(exc):
                return None
            raise


class EngineClient(HttpClient):
    """The embedded engine's control calls."""

    async def served_model(self) -> str:
        """The model name the engine answers to (`GET /v1/models`)."""
        answer = await self.request("GET", "/v1/models")
        return str(answer["data"][0]["id"])

    async def reload(self, path: str, weights_version: int) -> Any:
        """Serve the weights saved at `path` as `weights_version` from the next request on."""
        return await self.request("POST", "/reload", {"path": path, "weights_version": weights_version})
