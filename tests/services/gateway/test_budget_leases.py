"""A gateway reserves budget ahead for an attempt's next calls (`proxy/leases.py`): real gateways over HTTP,
a real nats-server, the attempt's shared entry read from the real key-value bucket.

Each call used to write the entry twice (its reservation, then its settlement). Now the write that
admits a call also holds a lease for the next ones; what the calls spent is written at the next write,
and an attempt idle for `IDLE_S` (or a gateway that stops) gives the lease back, leaving exactly what
was spent.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import openai
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle, Served, gateway_settings

from services.common.eventstore import EventStore
from services.gateway import create_app
from services.gateway.idempotency import derive_id
from services.gateway.proxy import budgets
from services.gateway.proxy.leases import IDLE_S
from services.gateway.proxy.ledger import BUCKET, Ledger

HI: Any = [{"role": "user", "content": "hello"}]


def _run(gateway: GatewayHandle, run_id: str, **spec: Any) -> None:
    r = gateway.admin.post("/api/runs", json={"run_id": run_id, "command": ["true"], **spec})
    assert r.status_code == 201, r.text


async def _entry(store: EventStore, run_id: str, attempt_id: str) -> Ledger:
    kv = await store.js.key_value(BUCKET)
    got = await kv.get(derive_id(run_id, attempt_id, "budget", length=48))
    return msgspec.json.decode(got.value or b"{}", type=Ledger)


async def _writes(store: EventStore) -> int:
    return (await store.js.stream_info(f"KV_{BUCKET}")).state.last_seq


async def _calls(attempt: dict[str, Any], count: int, max_tokens: int = 4) -> int:
    """Make `count` calls one after the other; the tokens the engine reported for them."""
    client = openai.AsyncOpenAI(base_url=attempt["proxy_base_url"], api_key=attempt["token"], max_retries=0)
    used = 0
    for _ in range(count):
        answer = await client.chat.completions.create(model="fake", messages=HI, max_tokens=max_tokens)
        used += answer.usage.total_tokens if answer.usage else 0
    await client.close()
    return used


async def test_calls_draw_on_a_lease_and_an_idle_attempt_gives_it_back(
    gateway: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, store: EventStore
) -> None:
    _run(gateway, run_id, budget={"calls": 1000, "tokens": 1_000_000})
    _, attempt = gateway.running(run_id, fake_vllm.url)
    before = await _writes(store)
    used = await _calls(attempt, 40)
    writes = await _writes(store) - before
    during = await _entry(store, run_id, attempt["attempt_id"])
    print(f"\n40 calls: {writes} writes of the attempt's entry (80 before leases)")
    assert writes <= 6, writes
    assert during.held_calls > 0  # the lease is still held while the attempt may call again
    await asyncio.sleep(IDLE_S + 1.0)
    after = await _entry(store, run_id, attempt["attempt_id"])
    assert (after.calls, after.tokens) == (40, used), after
    assert (after.held_calls, after.held, after.held_bytes) == (0, 0, 0), after


async def test_a_lease_never_passes_the_budget_and_the_last_calls_are_refused_exactly(
    gateway: GatewayHandle, second: GatewayHandle, fake_vllm: FakeVLLM, run_id: str, store: EventStore
) -> None:
    """40 calls under a 25-call budget, alternating between two gateways that each lease ahead: 25 are
    admitted, then each gateway refuses with the budget's figure once the other gave its lease back."""
    _run(gateway, run_id, budget={"calls": 25})
    _, attempt = gateway.running(run_id, fake_vllm.url)
    urls = [attempt["proxy_base_url"], attempt["proxy_base_url"].replace(gateway.url, second.url)]
    clients = [openai.AsyncOpenAI(base_url=u, api_key=attempt["token"], max_retries=0) for u in urls]
    admitted = refused = 0
    for i in range(40):
        try:
            await clients[i % 2].chat.completions.create(model="fake", messages=HI, max_tokens=2)
            admitted += 1
        except openai.PermissionDeniedError as exc:
            assert exc.body["param"] == "calls"  # type: ignore[index]
            refused += 1
    for client in clients:
        await client.close()
    assert (admitted, refused) == (25, 15)
    await asyncio.sleep(IDLE_S + 1.0)
    entry = await _entry(store, run_id, attempt["attempt_id"])
    assert entry.calls == 25 and entry.held_calls == 0, entry


async def test_a_stopping_gateway_gives_its_lease_back(
    nats_url: str, fake_vllm: FakeVLLM, run_id: str, store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budgets, "IDLE_S", 600.0)  # only the stop can give it back
    settings = gateway_settings(nats_url)
    with Served(create_app(settings), settings.port) as served:
        own = GatewayHandle(served, settings)
        _run(own, run_id, budget={"calls": 1000})
        _, attempt = own.running(run_id, fake_vllm.url)
        await _calls(attempt, 3)
        held = await _entry(store, run_id, attempt["attempt_id"])
        own.admin.close()
    assert held.held_calls > 0
    entry = await _entry(store, run_id, attempt["attempt_id"])
    assert (entry.calls, entry.held_calls, entry.held) == (3, 0, 0), entry
