"""Two gateway processes on one stream: an Idempotency-Key holds across them, a rollout keeps its engine, and
a rollout id belongs to one run however many create it at once."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle
from typing import Any

import httpx
import openai
from fake_vllm import FakeVLLM
from gw_harness import ADMIN, GatewayHandle

from services.gateway.proxy.routing import sticky


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


def test_an_update_holds_and_drains_calls_on_both_gateways(
    gateway: GatewayHandle, second: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    through_b = attempt["proxy_base_url"].replace(gateway.url, second.url)
    client: Any = openai.OpenAI(base_url=through_b, api_key=attempt["token"], max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    fake_vllm.delay_s = 1.5
    with ThreadPoolExecutor(2) as pool:
        in_flight = pool.submit(client.chat.completions.create, model="fake", messages=messages, max_tokens=2)
        time.sleep(0.5)  # the call is at the engine, on gateway B
        started = time.monotonic()
        update = gateway.admin.post("/api/phase", json={"run_id": run_id, "phase": "update"})
        assert update.status_code == 200, update.text
        assert in_flight.done() and time.monotonic() - started > 0.5  # A waited for B's call
        fake_vllm.delay_s = 0.0
        held = pool.submit(client.chat.completions.create, model="fake", messages=messages, max_tokens=2)
        time.sleep(1.0)
        assert not held.done()  # B holds new calls during the update
        back = gateway.admin.post("/api/phase", json={"run_id": run_id, "phase": "rollout", "weights_version": 2})
        assert back.status_code == 200
        held.result(timeout=10)
    events = gateway.admin.get(f"/api/rollouts/{rollout['rollout_id']}/events").json()
    calls = [e["seq"] for e in events if e["type"] == "model_request"]
    assert len(calls) == 2 and calls[0] < update.json()["seq"] < back.json()["seq"] < calls[1]


def test_an_attempt_ended_through_one_gateway_is_refused_by_the_other(
    gateway: GatewayHandle, second: GatewayHandle, fake_vllm: FakeVLLM, run_id: str
) -> None:
    rollout, attempt = gateway.running(run_id, fake_vllm.url)
    through_b = attempt["proxy_base_url"].replace(gateway.url, second.url)
    client: Any = openai.OpenAI(base_url=through_b, api_key=attempt["token"], max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="fake", messages=messages, max_tokens=2)  # B has the attempt cached
    rid = rollout["rollout_id"]
    for status in ("running", "succeeded"):
        ended = gateway.admin.patch(f"/api/rollouts/{rid}", json={"status": status})
        assert ended.status_code == 200, ended.text
    deadline = time.monotonic() + 5
    while True:
        try:
            client.chat.completions.create(model="fake", messages=messages, max_tokens=2)
        except openai.APIStatusError as exc:
            assert exc.status_code == 409
            break
        assert time.monotonic() < deadline, "gateway B still admits calls of an attempt ended through A"
        time.sleep(0.05)


async def test_one_rollout_id_created_in_two_runs_at_once_exists_in_one(
    gateway: GatewayHandle, second: GatewayHandle, run_id: str
) -> None:
    """30 concurrent creates of one rollout id, in two runs, through two gateways: the id belongs to one run.

    Every create in that run answers the rollout (201), every create in the other run is a 409 naming
    the run that has it, and the stream holds one `created` event and one `queuing` status. Once, 17
    of 30 such creates were appended."""
    rollout_id = f"{run_id}-shared"
    runs = [f"{run_id}-a", f"{run_id}-b"]
    auth = {"authorization": f"Bearer {ADMIN}"}
    run_of = [runs[i // 2 % 2] for i in range(30)]  # both runs through both gateways
    async with httpx.AsyncClient(headers=auth, timeout=30) as client:
        answers = await asyncio.gather(
            *(
                client.post(
                    f"{(gateway, second)[i % 2].url}/api/rollouts",
                    json={"rollouts": [{"run_id": run_of[i], "rollout_id": rollout_id, "input": i}]},
                )
                for i in range(30)
            )
        )
    ok = [a for a in answers if a.status_code == 201]
    assert {a.json()["rollouts"][0]["run_id"] for a in ok} == {owner := ok[0].json()["rollouts"][0]["run_id"]}
    refused = [a for a in answers if a.status_code != 201]
    assert len(ok) == run_of.count(owner) and len(refused) == 30 - len(ok), [a.text for a in answers]
    assert all(a.status_code == 409 and owner in a.json()["error"] for a in refused)
    store = gateway.gw.store
    created = [s async for s in store.read(f"rl.*.rollout.{rollout_id}.created")]
    statuses = [s async for s in store.read(f"rl.*.rollout.{rollout_id}.status")]
    assert len(created) == 1 and len(statuses) == 1, (created, statuses)
