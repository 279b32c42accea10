"""Every input bounded where it enters: integers Postgres cannot hold are 422s naming the field."""

from __future__ import annotations

import httpx
import pytest
from gw_harness import GatewayHandle

BIG = 3_000_000_000


def test_reward_step_out_of_range_is_refused(gateway: GatewayHandle, run_id: str) -> None:
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    agent = httpx.Client(headers={"authorization": f"Bearer {attempt['token']}"}, timeout=10)
    r = agent.post(attempt["events_url"], json={"type": "reward", "value": 1.0, "step": BIG})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "step"
    ok = agent.post(attempt["events_url"], json={"type": "reward", "value": 1.0, "step": 7})
    assert ok.status_code == 201, ok.text


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/phase", {"phase": "rollout", "weights_version": BIG}, "weights_version"),
        ("/api/models", {"name": "m", "base_url": "http://127.0.0.1:1/v1", "weights_version": BIG}, "weights_version"),
        ("/api/models", [{"model": "m", "endpoint": "http://127.0.0.1:1/v1", "version": BIG}], "[0].version"),
        ("/api/rollouts", {"rollouts": [{"input": 1, "max_attempts": BIG}]}, "rollouts[0].max_attempts"),
        ("/api/runs", {"run_id": "bounds-run", "concurrency": BIG}, "concurrency"),
    ],
)
def test_admin_integers_out_of_range_are_refused(
    gateway: GatewayHandle, run_id: str, path: str, body: object, field: str
) -> None:
    if isinstance(body, dict) and path != "/api/runs":
        body = {**body, "run_id": run_id} if "rollouts" not in body else body
    r = gateway.admin.post(path, json=body)
    assert r.status_code == 422, r.text
    assert r.json().get("field") == field, r.text
