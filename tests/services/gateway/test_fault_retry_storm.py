"""Fault: a retry storm. Hundreds of identical keyed commands at once, from an agent and an admin,
half of them after the process cache forgot the key: each command is one event, every answer the same."""

from __future__ import annotations

import asyncio

import httpx
from gw_harness import ADMIN, GatewayHandle

STORM = 200


async def test_retry_storm_appends_each_command_once(gateway: GatewayHandle, run_id: str) -> None:
    rollout = gateway.create(run_id)[0]
    attempt = gateway.attempt(rollout["rollout_id"])
    agent = {"authorization": f"Bearer {attempt['token']}", "idempotency-key": f"storm-{run_id}"}
    admin = {"authorization": f"Bearer {ADMIN}", "idempotency-key": f"storm-create-{run_id}"}
    batch = {"rollouts": [{"run_id": run_id, "input": {"storm": True}}]}
    limits = httpx.Limits(max_connections=50)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as client:

        async def send(url: str, body: object, headers: dict[str, str]) -> httpx.Response:
            for _ in range(5):  # a connection the server dropped under the storm is retried, as clients do
                try:
                    return await client.post(url, json=body, headers=headers)
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            raise AssertionError("the gateway kept dropping the connection")

        async def reward() -> httpx.Response:
            return await send(attempt["events_url"], {"type": "reward", "value": 1.0}, agent)

        async def create() -> httpx.Response:
            return await send("/api/rollouts", batch, admin)

        first = await asyncio.gather(*(reward() for _ in range(STORM)), *(create() for _ in range(STORM)))
        gateway.gw.idempotency._entries.clear()  # as if the storm reached another gateway process
        second = await asyncio.gather(*(reward() for _ in range(STORM)), *(create() for _ in range(STORM)))
    rewards = [r for r in first[:STORM] + second[:STORM]]
    creates = [r for r in first[STORM:] + second[STORM:]]
    assert {r.status_code for r in rewards} == {201} and len({r.json()["seq"] for r in rewards}) == 1
    assert {r.status_code for r in creates} == {201}
    assert len({r.json()["rollouts"][0]["rollout_id"] for r in creates}) == 1
    events = gateway.admin.get(f"/api/rollouts/{rollout['rollout_id']}/events", params={"type": "reward"}).json()
    assert len(events) == 1
    listed = gateway.admin.get("/api/rollouts", params={"run_id": run_id}).json()
    assert len(listed) == 2  # the first rollout and the stormed one, once
