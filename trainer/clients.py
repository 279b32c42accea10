"""Where the trainer's services are, and its client of the gateway's API (`services.common.gateway_api`).

Every write carries an `Idempotency-Key` derived from what it does (run, step, phase), so a call
retried after a timeout, or repeated by a resumed run, is applied once. Transient failures (a
connection error, 502/503/504) are retried with backoff; anything else is a `GatewayError`
carrying the gateway's own message.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.gateway_api import GatewayClient

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


def gateway_client(urls: ServiceUrls) -> GatewayClient:
    """The gateway's API as the trainer calls it: admin token, transient failures retried with backoff."""
    return GatewayClient(urls.gateway_url, urls.admin_token, retries=RETRIES)
