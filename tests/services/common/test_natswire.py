"""The lean NATS connection under the event store's publishes, against real nats-servers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import nats
import nats.errors
import pytest

from schemas import RolloutCreated
from services.common.eventstore import EventStore
from services.common.jspublish import PipelinedAcks
from services.common.natswire import NatsWire, WireError
from services.devstack.embedded import free_port, nats_server_binary, port_in_use


@pytest.fixture
def strict_nats(tmp_path: Path) -> Iterator[str]:
    """A nats-server that pings every 200 ms (a client that does not answer two is dropped) and has one
    user, `svc` with password `pw`: its host:port."""
    port = free_port()
    config = tmp_path / "nats.conf"
    users = json.dumps([{"user": "svc", "password": "pw"}])
    config.write_text(
        f'listen: "127.0.0.1:{port}"\nping_interval: "200ms"\nping_max: 2\n'
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\nauthorization {{ users = {users} }}\n'
    )
    proc = subprocess.Popen([str(nats_server_binary()), "-c", str(config)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if port_in_use(port):
                break
            proc.poll()
            assert proc.returncode is None, "nats-server exited"
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _created(run_id: str) -> RolloutCreated:
    return RolloutCreated(run_id=run_id, rollout_id=f"r-{run_id}", input={"q": 1}, event_id=f"created-{run_id}")


async def test_appends_travel_on_the_lean_connection(store: EventStore, run_id: str) -> None:
    first = await store.append(_created(run_id))
    acks = store._acks
    assert acks.wire is not None and acks.wire.connected
    assert not acks._subscribed  # no reply subscription on nats-py's connection
    again = await store.append(_created(run_id))
    assert again.duplicate and again.seq == first.seq


async def test_credentials_of_the_url_and_pings_answered(strict_nats: str, run_id: str) -> None:
    store = await EventStore.connect(f"nats://svc:pw@{strict_nats}")
    try:
        await store.append(_created(run_id))
        wire = store._acks.wire
        assert wire is not None and wire.connected
        await asyncio.sleep(1.5)  # seven pings: unanswered, the server drops the connection after two
        assert store._acks.wire is wire and wire.connected
        await store.append(_created(run_id + "b"))
    finally:
        await store.close()


async def test_a_wire_that_cannot_log_in_leaves_publishing_to_nats_py(strict_nats: str) -> None:
    """nats-py logged in with options the URL does not carry: the lean connection is refused, and the
    publishes and their acks go through nats-py's connection instead."""
    nc = await nats.connect(f"nats://{strict_nats}", user="svc", password="pw")
    try:
        js = nc.jetstream()
        await js.add_stream(name="wiretest", subjects=["wiretest.>"])
        acks = PipelinedAcks(nc)
        seq, duplicate = await acks.request("wiretest.a", b"{}", {"Nats-Msg-Id": "one"}, timeout=5)
        assert (seq, duplicate) == (1, False)
        assert acks.wire is None and acks._subscribed
    finally:
        await nc.close()


async def test_a_lost_wire_fails_what_waits_and_is_made_again(store: EventStore, run_id: str) -> None:
    await store.append(_created(run_id))
    acks = store._acks
    wire = acks.wire
    assert wire is not None and wire.transport is not None
    waiting: asyncio.Future[tuple[int, bool]] = asyncio.get_running_loop().create_future()
    acks.waiting["never-answered"] = waiting
    wire.transport.abort()  # the connection breaks under it
    with pytest.raises(TimeoutError, match="dropped"):
        await asyncio.wait_for(waiting, 5)
    await store.append(_created(run_id + "b"))  # made again by the next publish
    assert acks.wire is not None and acks.wire is not wire and acks.wire.connected


async def test_a_connection_the_server_closes_with_an_error_fails_what_waits_at_once(
    store: EventStore, run_id: str
) -> None:
    """The server refuses a message past its max_payload with -ERR and closes the connection: what waits
    on it fails then (not at its timeout), and the next publish makes a new one."""
    await store.append(_created(run_id))
    acks = store._acks
    wire = acks.wire
    assert wire is not None
    subject = _created(run_id).subject
    _, waiting = await acks.send(subject, b"x" * (store.max_payload + 1), None)
    with pytest.raises(TimeoutError, match="dropped"):
        await asyncio.wait_for(waiting, 3)  # the ack timeout is 5 s: only the loss fails it this soon
    await store.append(_created(run_id + "b"))
    assert acks.wire is not None and acks.wire is not wire and acks.wire.connected


async def test_line_breaks_cannot_inject_commands(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        url = nc.connected_url
        assert url is not None
        wire = await NatsWire.open(url, "_INBOX.t.*", lambda *_: None, lambda _: None, name="t", timeout=5)
        try:
            with pytest.raises(nats.errors.BadSubjectError):
                wire.publish("rl.x\r\nPUB evil 1", "_INBOX.t.1", b"x", None)
            with pytest.raises(ValueError, match="line break"):
                wire.publish("rl.x", "_INBOX.t.1", b"x", {"Nats-Msg-Id": "a\r\nPUB evil 1\r\nx"})
        finally:
            wire.close()
    finally:
        await nc.close()


async def test_nothing_listening_is_a_wire_error() -> None:
    port = free_port()
    url = urlparse(f"nats://127.0.0.1:{port}")
    with pytest.raises(WireError):
        await NatsWire.open(url, "_INBOX.t.*", lambda *_: None, lambda _: None, name="t", timeout=2)


async def test_a_put_without_a_task_gives_its_revision_or_none(store: EventStore, run_id: str) -> None:
    bucket = f"nowait_{run_id}".replace("-", "_")
    assert store.kv_put_nowait(bucket, "k", b"v") is None  # no lean connection yet: use kv_write
    await store.append(_created(run_id))  # the first publish makes it
    kv = await store.nc.jetstream().create_key_value(bucket=bucket)
    try:
        put = store.kv_put_nowait(bucket, "k", b"v")
        assert put is not None
        revision = await put
        assert revision is not None and (await kv.get("k")).revision == revision
        missing = store.kv_put_nowait(bucket + "_none", "k", b"v")  # no such bucket: nothing stored
        assert missing is not None and await missing is None
        assert not store._acks.waiting
    finally:
        await store.nc.jetstream().delete_key_value(bucket)


async def test_large_events_in_batches_past_the_flush_size_arrive_whole_and_in_order(
    store: EventStore, run_id: str
) -> None:
    """Payloads past the join size go to the socket as a vector; a batch past 1 MiB is written before the turn ends."""
    events = [
        RolloutCreated(run_id=run_id, rollout_id=f"r{i}", input={"text": f"{i}:" + "x" * 40_000}, event_id=f"big-{i}")
        for i in range(60)  # about 2.4 MB in one turn
    ]
    appended = await store.append_many(events)
    assert [a.duplicate for a in appended] == [False] * 60
    assert [a.seq for a in appended] == sorted(a.seq for a in appended)
    read = [stored.event async for stored in store.read_run(run_id)]
    assert read == events
