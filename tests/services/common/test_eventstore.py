"""The event store against a real nats-server with JetStream."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from msgspec import UNSET

from schemas import CustomEvent, ModelRequestRecorded, RewardReported, RolloutCreated, RolloutStatusChanged
from schemas.refs import pack, upcast
from services.common.eventstore import ConcurrencyConflict, EventStore, EventStoreUnavailable, raise_if_cancelling
from services.devstack.embedded import NatsServer


async def test_append_then_read_in_order(store: EventStore, run_id: str) -> None:
    events = [RewardReported(run_id=run_id, rollout_id="ro", value=float(i)) for i in range(20)]
    seqs = [(await store.append(e)).seq for e in events]
    assert seqs == sorted(seqs)
    read = await store.read_rollout(run_id, "ro")
    assert [s.event for s in read] == events
    assert [s.seq for s in read] == seqs


async def test_same_event_id_is_a_duplicate(store: EventStore, run_id: str) -> None:
    event = RewardReported(run_id=run_id, rollout_id="ro", value=1.0)
    first = await store.append(event)
    second = await store.append(event)
    assert not first.duplicate
    assert second.duplicate and second.seq == first.seq
    assert len(await store.read_rollout(run_id, "ro")) == 1


async def test_pipelined_appends_keep_order(store: EventStore, run_id: str) -> None:
    events = [RewardReported(run_id=run_id, rollout_id="p", value=float(i)) for i in range(300)]
    results = await store.append_many(events)
    assert [r.seq for r in results] == sorted(r.seq for r in results)
    assert [s.event for s in await store.read_rollout(run_id, "p")] == events


async def test_concurrent_appends_with_same_expected_sequence_one_wins(store: EventStore, run_id: str) -> None:
    queued = await store.append(RolloutStatusChanged(run_id=run_id, rollout_id="ro", status="queuing"), 0)
    attempts = [
        store.append(
            RolloutStatusChanged(run_id=run_id, rollout_id="ro", status="running", attempt_id=f"a{i}"),
            expected_last_subject_seq=queued.seq,
        )
        for i in range(8)
    ]
    results = await asyncio.gather(*attempts, return_exceptions=True)
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1
    assert len(losers) == 7 and all(isinstance(e, ConcurrencyConflict) for e in losers)
    last, seq = await store.last_status(run_id, "ro")
    assert last is not None and last.status == "running" and seq == winners[0].seq


async def test_last_status_of_unknown_rollout(store: EventStore, run_id: str) -> None:
    assert await store.last_status(run_id, "nobody") == (None, 0)


async def test_read_rollout_only_that_rollout_and_ends_on_idle_stream(store: EventStore, run_id: str) -> None:
    await store.append(RolloutCreated(run_id=run_id, rollout_id="a", input=1))
    await store.append(RolloutCreated(run_id=run_id, rollout_id="ab", input=2))
    await store.append(CustomEvent(run_id=run_id, rollout_id="a", name="log", payload={}))
    started = time.monotonic()
    got = await asyncio.wait_for(store.read_rollout(run_id, "a"), timeout=5)
    assert time.monotonic() - started < 2
    assert [s.event.rollout_id for s in got] == ["a", "a"]
    assert await asyncio.wait_for(store.read_rollout(run_id, "empty"), timeout=5) == []


async def test_read_run_spans_rollouts(store: EventStore, run_id: str) -> None:
    await store.append(RolloutCreated(run_id=run_id, rollout_id="a", input=1))
    await store.append(RolloutCreated(run_id=run_id, rollout_id="b", input=2))
    await store.append(RolloutCreated(run_id=f"{run_id}x", rollout_id="c", input=3))
    got = [s.event.rollout_id async for s in store.read_run(run_id)]
    assert got == ["a", "b"]


async def test_subscribe_with_wildcards_receives_only_matching(store: EventStore, run_id: str) -> None:
    await store.append(RewardReported(run_id=run_id, rollout_id="x", value=1.0))
    await store.append(CustomEvent(run_id=run_id, rollout_id="x", name="noise"))
    await store.append(RolloutCreated(run_id=run_id, rollout_id="y"))
    await store.append(RewardReported(run_id=f"{run_id}other", rollout_id="z", value=5.0))
    await store.append(RewardReported(run_id=run_id, rollout_id="y", value=0.0))
    received: list[str] = []
    async for stored in store.subscribe(f"rl.{run_id}.rollout.*.reward", start="start"):
        received.append(stored.subject)
        if len(received) == 2:
            break
    assert received == [f"rl.{run_id}.rollout.x.reward", f"rl.{run_id}.rollout.y.reward"]


async def test_subscribe_from_new_skips_history_and_follows(store: EventStore, run_id: str) -> None:
    await store.append(RewardReported(run_id=run_id, rollout_id="old", value=1.0))
    agen = store.subscribe(f"rl.{run_id}.>", start="new")
    pending = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0.5)  # the consumer is created on the first pull
    await store.append(RewardReported(run_id=run_id, rollout_id="new", value=2.0))
    got = await asyncio.wait_for(pending, timeout=10)
    await agen.aclose()
    assert got.event.rollout_id == "new"


async def test_subscribe_from_start_sees_history(store: EventStore, run_id: str) -> None:
    await store.append(RewardReported(run_id=run_id, rollout_id="h", value=2.0))
    agen = store.subscribe(f"rl.{run_id}.>", start="start")
    first = await asyncio.wait_for(agen.__anext__(), timeout=5)
    await agen.aclose()
    assert isinstance(first.event, RewardReported) and first.event.value == 2.0


async def test_subscribe_can_leave_a_calls_arrays_packed(store: EventStore, run_id: str) -> None:
    call = ModelRequestRecorded(run_id=run_id, rollout_id="p", call_id="c", packed=pack([1, 2], [3], [-0.5]))
    await store.append(call)
    for unpack, arrays in ((True, ([1, 2], [3], [-0.5])), (False, ([], [], []))):
        agen = store.subscribe(f"rl.{run_id}.rollout.p.model_request", start="start", unpack=unpack)
        got = (await asyncio.wait_for(agen.__anext__(), timeout=5)).event
        await agen.aclose()
        assert isinstance(got, ModelRequestRecorded) and (got.prompt_ids, got.response_ids, got.logprobs) == arrays
        assert got.packed == (UNSET if unpack else call.packed) and upcast(got) == upcast(call)


async def test_durable_subscription_resumes_after_restart(store: EventStore, run_id: str) -> None:
    for i in range(3):
        await store.append(RewardReported(run_id=run_id, rollout_id="d", value=float(i)))
    durable = f"mon-{run_id}"
    agen = store.subscribe(f"rl.{run_id}.>", start="start", durable=durable)
    first = await asyncio.wait_for(agen.__anext__(), timeout=5)
    second = await asyncio.wait_for(agen.__anext__(), timeout=5)  # asking for the 2nd acks the 1st
    await agen.aclose()
    assert [first.event.value, second.event.value] == [0.0, 1.0]  # type: ignore[union-attr]
    agen = store.subscribe(f"rl.{run_id}.>", start="start", durable=durable)
    resumed = await asyncio.wait_for(agen.__anext__(), timeout=10)
    await agen.aclose()
    # The second event was handed out but never finished, so the restarted monitor gets it again;
    # the first one is never seen again.
    assert resumed.event.value == 1.0  # type: ignore[union-attr]


async def test_connect_fails_fast_when_no_server() -> None:
    started = time.monotonic()
    with pytest.raises(EventStoreUnavailable, match="no NATS server answers"):
        await EventStore.connect("nats://127.0.0.1:1", timeout=0.5)
    assert time.monotonic() - started < 3


async def test_a_cancellation_a_timeout_swallowed_still_stops_a_retry_loop() -> None:
    async def swallowing_wait() -> None:  # what asyncio.wait_for can do on 3.11 when both race
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise TimeoutError from None

    async def retry_loop() -> None:
        while True:
            try:
                await swallowing_wait()
            except TimeoutError:
                raise_if_cancelling()

    task = asyncio.create_task(retry_loop())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_a_publish_waiting_for_its_ack_fails_at_once_when_nats_dies(fresh_nats: NatsServer) -> None:
    """The ack of a publish in flight goes with the connection: its caller is answered as by a timeout
    (it may or may not be stored) when the connection drops, not after the whole ack timeout."""
    store = await EventStore.connect(fresh_nats.url, ensure=False)
    await store.nc.subscribe("swallow.>")  # answers nothing, so no "no responders" either
    try:
        waiting = asyncio.ensure_future(store._acks.request("swallow.one", b"x", {}, timeout=30))
        await asyncio.sleep(0.2)
        assert not waiting.done() and fresh_nats.proc is not None
        fresh_nats.proc.send_signal(signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await waiting
        assert time.monotonic() - started < 5  # the connection's drop, not the 30 s timeout
        fresh_nats.proc.wait()
        fresh_nats.proc = None
    finally:
        await store.close()
