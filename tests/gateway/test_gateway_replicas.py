"""Two gateway processes on one stream: an Idempotency-Key holds across them, and a rollout keeps its engine."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import cycle

import pytest
from gw_harness import ADMIN, GatewayHandle, Served, gateway_settings

from services.gateway import create_app
from services.gateway.routing import sticky


@pytest.fixture
def second(gateway: GatewayHandle, nats_url: str) -> Iterator[GatewayHandle]:
    """Another gateway process's worth of state (own caches) on the same NATS."""
    settings = gateway_settings(nats_url)
    with Served(create_app(settings), settings.port) as served:
        handle = GatewayHandle(served, settings)
        yield handle
        handle.admin.close()


def test_a_key_reused_for_another_body_through_another_gateway_is_refused(
    gateway: GatewayHandle, second: GatewayHandle, run_id: str
) -> None:
    replicas = cycle([gateway, second])  # round-robin
    headers = {"authorization": f"Bearer {ADMIN}", "idempotency-key": f"k-{run_id}"}
    first = next(replicas).admin.post(
        "/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": 1}]}, headers=headers
    )
    assert first.status_code == 201, first.text
    other = next(replicas).admin.post(
        "/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": 2}]}, headers=headers
    )
    assert other.status_code == 409 and "Idempotency-Key" in other.text
    repeat = next(replicas).admin.post(
        "/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": 1}]}, headers=headers
    )
    assert repeat.status_code == 201
    assert repeat.json()["rollouts"][0]["rollout_id"] == first.json()["rollouts"][0]["rollout_id"]
    listed = gateway.admin.get("/api/rollouts", params={"run_id": run_id}).json()
    items = listed["items"] if isinstance(listed, dict) else listed
    assert len(items) == 1 and items[0]["input"] == 1


class _Endpoint:
    def __init__(self, name: str) -> None:
        self.name, self.base_url = name, f"http://{name}:8000/v1"


def test_a_rollout_keeps_its_engine_replica_and_only_a_share_moves_when_one_is_added() -> None:
    three = [_Endpoint(n) for n in ("a", "b", "c")]
    four = [*three, _Endpoint("d")]
    rollouts = [f"r{i}" for i in range(2000)]
    before = {r: sticky(r, three).name for r in rollouts}
    assert before == {r: sticky(r, list(reversed(three))).name for r in rollouts}  # order-free: any replica agrees
    assert all(n > 550 for n in Counter(before.values()).values())  # spread over the replicas
    after = {r: sticky(r, four).name for r in rollouts}
    moved = [r for r in rollouts if after[r] != before[r]]
    assert all(after[r] == "d" for r in moved) and 350 < len(moved) < 650  # only what d wins moves
