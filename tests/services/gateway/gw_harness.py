"""Test harness of the gateway: ASGI apps served by uvicorn in threads, and an admin client."""

from __future__ import annotations

from typing import Any

import httpx
from served import Served

from services.devstack.embedded import free_port
from services.gateway import GatewaySettings

ADMIN = "admin-token-for-tests"
SECRET = "signing-secret-for-tests"


def gateway_settings(nats_url: str, **overrides: Any) -> GatewaySettings:
    """Settings of a test gateway (short timeouts)."""
    base: dict[str, Any] = {
        "nats_url": nats_url,
        "admin_token": ADMIN,
        "secret": SECRET,
        "port": free_port(),
        "upstream_timeout_s": 2.0,
        "phase_hold_timeout_s": 5.0,
        "drain_timeout_s": 10.0,
        "max_body_bytes": 1_000_000,
    }
    base.update(overrides)
    return GatewaySettings(**base)


class GatewayHandle:
    """A running gateway and an admin client for it."""

    def __init__(self, served: Served, settings: GatewaySettings) -> None:
        self.url = served.url
        self.app = served.app
        self.settings = settings
        self.admin = httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)

    @property
    def gw(self) -> Any:
        """The in-process gateway object (state, gate, store)."""
        return self.app.state.gateway

    def register_model(self, run_id: str, base_url: str, name: str = "fake", **extra: Any) -> None:
        """Register an endpoint as the run's model."""
        r = self.admin.post("/api/models", json={"name": name, "base_url": base_url, "run_id": run_id, **extra})
        assert r.status_code == 201, r.text

    def create(self, run_id: str, n: int = 1, **fields: Any) -> list[dict[str, Any]]:
        """Create n rollouts in a run."""
        r = self.admin.post(
            "/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": {"i": i}, **fields} for i in range(n)]}
        )
        assert r.status_code == 201, r.text
        return r.json()["rollouts"]  # type: ignore[no-any-return]

    def attempt(self, rollout_id: str, **body: Any) -> dict[str, Any]:
        """Start an attempt; returns its token and URLs."""
        r = self.admin.post(f"/api/rollouts/{rollout_id}/attempts", json=body)
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]

    def running(
        self, run_id: str, base_url: str, served_model: str | None = None, **fields: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A rollout with a started attempt in a run whose model is the given upstream."""
        self.register_model(run_id, f"{base_url}/v1", served_model=served_model)
        rollout = self.create(run_id, **fields)[0]
        return rollout, self.attempt(rollout["rollout_id"])
