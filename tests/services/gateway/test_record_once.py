"""One terminal record per call, whatever the timing: of a call's owner and a reaper, exactly one records it.

A gateway paused longer than three heartbeats (SIGSTOP here, as a long GC pause or a frozen VM
would) has its call reaped as `aborted` by a replica; when it resumes, it used to record the call
`ok` as well: two terminal records for one call (2 -> 1 here). Both now claim the call's marker in
`rollwire_inflight` by compare-and-set before appending, and the loser appends nothing: the resumed
gateway answers 503 (retry) instead. The first two tests drive the claim in both orders with two
real reapers on a real nats-server; the last one pauses a real gateway process with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVLLM
from gw_harness import GatewayHandle, Served, gateway_settings
from nats.aio.client import ServerVersion
from nats.js.api import StreamConfig
from test_reaper import INTERVAL_S, _events, _markers, _start_gateway

from services.common.eventstore import EventStore, EventStoreError
from services.devstack.embedded import NatsServer, free_port
from services.gateway import create_app
from services.gateway.proxy.reaper import CALLS, CallReaper, require_msg_ttl


async def _pair(url: str) -> tuple[CallReaper, CallReaper, EventStore, EventStore]:
    """An owner's reaper and a replica's, each on its own connection, both started."""
    stores = [await EventStore.connect(url), await EventStore.connect(url)]
    owner, replica = (CallReaper(store, interval_s=0.2) for store in stores)
    await owner.start()
    await replica.start()
    return owner, replica, stores[0], stores[1]


async def _reaped(store: EventStore, run: str) -> list[Any]:
    return [s.event async for s in store.read(f"rl.{run}.rollout.*.model_request")]


async def _until(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_reaper_that_claims_first_makes_the_owner_record_nothing(fresh_nats: NatsServer) -> None:
    owner, replica, mine, theirs = await _pair(fresh_nats.url)
    try:
        owner.started("run1", "r1", "a1", "call1", "train", "m")
        await _until(lambda: _opened(replica, "call1"))
        await owner.stop()  # its heartbeat is withdrawn: to the replica, the owner is dead
        await asyncio.sleep(0.25)  # past the reaper's grace for a call it just saw
        await replica.reap()
        assert replica.reaped == 1
        assert not await owner.claim("call1"), "the owner claimed a call a reaper had recorded"
        events = await _reaped(theirs, "run1")
        assert [(e.call_id, e.status) for e in events] == [("call1", "aborted")]
    finally:
        await replica.stop()
        await mine.close()
        await theirs.close()


async def test_an_owner_that_claims_first_is_not_reaped(fresh_nats: NatsServer) -> None:
    owner, replica, mine, theirs = await _pair(fresh_nats.url)
    try:
        owner.started("run2", "r2", "a2", "call2", "train", "m")
        await _until(lambda: _opened(replica, "call2"))
        assert await owner.claim("call2")  # the owner is about to record it (its claim deletes the marker) ...
        await owner.stop()  # ... and stalls (its heartbeat expires) before its append
        await _until(lambda: _closed(replica, "call2"))
        await asyncio.sleep(0.25)
        await replica.reap()
        assert replica.reaped == 0
        assert await _reaped(theirs, "run2") == []  # the owner's record is the only one to come
    finally:
        await replica.stop()
        await mine.close()
        await theirs.close()


async def test_a_claimed_markers_delete_marker_is_not_reaped(fresh_nats: NatsServer) -> None:
    owner, replica, mine, theirs = await _pair(fresh_nats.url)
    try:
        owner.started("run3", "r3", "a3", "call3", "train", "m")
        await _until(lambda: _opened(replica, "call3"))
        await asyncio.sleep(0.25)  # the replica saw the call a whole interval ago
        assert await owner.claim("call3")  # its delete marker lives a second: listed, but not a call
        await owner.stop()
        await replica.reap()
        assert "call3" in replica.open  # listed: the reaper read the delete marker, not an absence
        assert replica.reaped == 0
        assert await _reaped(theirs, "run3") == []
        await _until(lambda: _closed(replica, "call3"))  # the delete marker expired
        assert (await theirs.js.stream_info(f"KV_{CALLS}")).state.messages == 0
    finally:
        await replica.stop()
        await mine.close()
        await theirs.close()


async def test_a_markers_bucket_made_without_message_ttls_is_given_them(fresh_nats: NatsServer) -> None:
    store = await EventStore.connect(fresh_nats.url)
    try:
        made = StreamConfig(name=f"KV_{CALLS}", subjects=[f"$KV.{CALLS}.>"], max_msgs_per_subject=1, deny_delete=False)
        await store.js.add_stream(made)  # as gateways that erased markers by message delete made it
        owner = CallReaper(store, interval_s=0.2)
        await owner.start()
        try:
            assert (await store.js.stream_info(f"KV_{CALLS}")).config.allow_msg_ttl
            owner.started("run4", "r4", "a4", "call4", "train", "m")
            assert await owner.claim("call4")
            await _until(lambda: _empty(store))
        finally:
            await owner.stop()
    finally:
        await store.close()


def test_a_nats_server_without_message_ttls_is_refused() -> None:
    class Connected:  # what `require_msg_ttl` reads of nats-py's client: the server's version
        def __init__(self, version: str) -> None:
            self.connected_server_version = ServerVersion(version)

    with pytest.raises(EventStoreError, match=r"nats-server 2\.10 is too old: the gateway needs 2\.11"):
        require_msg_ttl(Connected("2.10.24"))  # type: ignore[arg-type]
    require_msg_ttl(Connected("2.11.0"))  # type: ignore[arg-type]


async def _empty(store: EventStore) -> bool:
    return (await store.js.stream_info(f"KV_{CALLS}")).state.messages == 0


async def _opened(reaper: CallReaper, call_id: str) -> bool:
    return call_id in reaper.open


async def _closed(reaper: CallReaper, call_id: str) -> bool:
    return call_id not in reaper.open


def test_a_gateway_paused_past_three_heartbeats_records_its_reaped_call_once(
    fake_vllm: FakeVLLM, run_id: str, tmp_path: Path
) -> None:
    nats = NatsServer(tmp_path / "nats").start()
    settings = gateway_settings(nats.url, reaper_interval_s=INTERVAL_S)
    port = free_port()
    while port == settings.port:
        port = free_port()
    victim = _start_gateway(nats.url, port, tmp_path)
    try:
        with Served(create_app(settings), settings.port) as served:
            survivor = GatewayHandle(served, settings)
            rollout, attempt = survivor.running(run_id, fake_vllm.url)
            fake_vllm.delay_s = 2.0  # the engine answers while the victim is paused
            base = attempt["proxy_base_url"].replace(survivor.url, f"http://127.0.0.1:{port}")
            answer: list[httpx.Response] = []

            def call() -> None:
                body = {"model": "fake", "messages": [{"role": "user", "content": "go"}], "max_tokens": 3}
                headers = {"authorization": f"Bearer {attempt['token']}"}
                answer.append(httpx.post(f"{base}/chat/completions", json=body, headers=headers, timeout=60))

            caller = threading.Thread(target=call)
            caller.start()
            deadline = time.monotonic() + 10
            while not _markers(nats.url):
                assert time.monotonic() < deadline, "the call never started"
                time.sleep(0.02)
            victim.send_signal(signal.SIGSTOP)  # paused mid-call, past three heartbeats
            subject = f"rl.{run_id}.rollout.{rollout['rollout_id']}.model_request"
            deadline = time.monotonic() + 20
            while not _events(nats.url, subject):
                assert time.monotonic() < deadline, "the paused gateway's call was never reaped"
                time.sleep(0.1)
            victim.send_signal(signal.SIGCONT)
            caller.join(60)
            time.sleep(1.0)  # anything the resumed gateway would append is on the stream by now
            records = _events(nats.url, subject)
            survivor.admin.close()
        print(f"\nrecords of a call reaped while its gateway was paused: {len(records)} (was 2); "
              f"the resumed gateway answered {answer[0].status_code}")  # fmt: skip
        assert [r.get("status", "ok") for r in records] == ["aborted"], records
        assert answer[0].status_code == 503, answer[0].text
        assert "aborted" in answer[0].json()["error"]["message"]
    finally:
        if victim.poll() is None:
            victim.send_signal(signal.SIGCONT)
            victim.kill()
        nats.stop()
