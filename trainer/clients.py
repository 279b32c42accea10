"""Where the trainer's services are, and its HTTP clients: the gateway's API and the engine's reload.

Both are `services.common.gateway_api` clients. Every write carries an `Idempotency-Key` derived
from what it does (run, step, phase), so a call retried after a timeout, or repeated by a resumed
run, is applied once. Transient failures (a connection error, 502/503/504) are retried with
backoff; anything else is a `GatewayError` carrying the gateway's (or the engine's) own message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.gateway_api import ApiClient, GatewayClient

RETRIES = 6


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


def gateway_client(urls: ServiceUrls) -> GatewayClient:
    """The gateway's API as the trainer calls it: admin token, transient failures retried with backoff."""
    return GatewayClient(urls.gateway_url, urls.admin_token, retries=RETRIES)


class EngineClient(ApiClient):
    """The embedded engine's control calls."""

    async def served_model(self) -> str:
        """The model name the engine answers to (`GET /v1/models`)."""
        answer = await self.request("GET", "/v1/models")
        return str(answer["data"][0]["id"])

    async def reload(self, path: str, weights_version: int) -> Any:
        """Serve the weights saved at `path` as `weights_version` from the next request on."""
        return await self.request("POST", "/reload", {"path": path, "weights_version": weights_version})
