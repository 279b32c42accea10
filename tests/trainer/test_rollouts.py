"""Waiting on status events (pushed by the stream), replaying rollouts, and dropping stale calls."""

from __future__ import annotations

import asyncio
import contextlib

from schemas import (
    AttemptStarted,
    CustomEvent,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
)
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer
from trainer.checkpoint import InFlightGroup
from trainer.core import CallTokens, RolloutCalls, drop_stale_calls
from trainer.rollouts import StatusWatch, replay_group


def rollout_events(run_id: str, rollout_id: str, group_id: str, reward: float, status: str) -> list:
    attempt = f"{rollout_id}-a1"
    call = ModelRequestRecorded(
        run_id=run_id,
        rollout_id=rollout_id,
        attempt_id=attempt,
        call_id=f"{rollout_id}-c0",
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        weights_version=3,
    )
    return [
        RolloutCreated(run_id=run_id, rollout_id=rollout_id, group_id=group_id, input={"q": 1}),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, status="queuing"),
        AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, sequence=1),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, status="running"),
        call,
        CustomEvent(
            run_id=run_id,
            rollout_id=rollout_id,
            attempt_id=attempt,
            name="metrics",
            payload={"tool_used": 1, "note": "x"},
        ),
        RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, value=reward),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, status=status),  # type: ignore[arg-type]
    ]


async def test_wait_groups_wakes_on_status_events_and_replay_builds_calls(store: EventStore, run_id: str) -> None:
    groups = [
        InFlightGroup(
            group_id=f"g{g}", rollout_ids=[f"{run_id}-g{g}-r{r}" for r in range(2)], task_index=g, created_version=3
        )
        for g in range(2)
    ]
    watch = StatusWatch(store, run_id)
    await watch.start(await store.last_sequence())
    try:
        waiting = asyncio.create_task(watch.wait_groups(groups, 1, timeout_s=20))
        first = groups[0].rollout_ids
        await store.append_many(rollout_events(run_id, first[0], "g0", 1.0, "succeeded"))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # half a group is not a group
        await store.append_many(rollout_events(run_id, first[1], "g0", 0.0, "failed"))
        ended = await waiting
        assert ended == [groups[0]] and watch.ended[first[1]] == "failed"

        replayed = await replay_group(store, run_id, groups[0])
        (calls,) = replayed.rollouts
        assert calls.rollout_id == first[0] and calls.reward == 1.0 and calls.group_id == "g0"
        assert [c.weights_version for c in calls.calls] == [3]
        assert replayed.skipped == {first[1]: "not-succeeded"}
        assert replayed.agent_metrics == [{"tool_used": 1.0}]

        late = StatusWatch(store, run_id)  # a resumed trainer adopts rollouts that ended while it was away
        await late.start(await store.last_sequence())
        await late.adopt(first)
        assert late.group_ended(groups[0]) and not late.group_ended(groups[1])
        await late.stop()
    finally:
        await watch.stop()


def test_drop_stale_calls_keeps_fresh_and_unversioned_calls() -> None:
    def call(i: int, version: int | None) -> CallTokens:
        return CallTokens(call_id=f"c{i}", prompt_ids=[1], response_ids=[2], logprobs=[-1.0], weights_version=version)

    rollout = RolloutCalls(
        run_id="r",
        rollout_id="x",
        group_id="g",
        attempt_id="a",
        reward=1.0,
        calls=[call(0, 3), call(1, 4), call(2, None), call(3, 5)],
    )
    kept, dropped = drop_stale_calls([rollout], version=5, max_staleness=1)
    assert dropped == 1 and [c.call_id for c in kept[0].calls] == ["c1", "c2", "c3"]
    same, none = drop_stale_calls([rollout], version=5, max_staleness=2)
    assert none == 0 and same[0] is rollout


async def test_the_status_watch_outlives_a_nats_restart(fresh_nats: NatsServer, run_id: str) -> None:
    """A nats-server restarted under a running watch (or too slow to answer for a while) does not stop the
    run: the watch takes its subscription up again after the last event it saw and sees what came after."""
    store = await EventStore.connect(fresh_nats.url)
    watch = StatusWatch(store, run_id)
    try:
        await watch.start(await store.last_sequence())
        group = InFlightGroup(
            group_id="g0", rollout_ids=[f"{run_id}-r0", f"{run_id}-r1"], task_index=0, created_version=0
        )
        await store.append_many(rollout_events(run_id, group.rollout_ids[0], "g0", 1.0, "succeeded"))
        fresh_nats.stop()
        await asyncio.sleep(1.5)
        fresh_nats.start()
        for _ in range(100):  # and JetStream forgot the watch's consumer (as when it was idle past its threshold)
            with contextlib.suppress(Exception):
                for name in await store.js.consumers_info(store.stream):
                    await store.js.delete_consumer(store.stream, name.name)
                break
            await asyncio.sleep(0.2)
        for _ in range(100):  # the client reconnects on its own
            with contextlib.suppress(Exception):
                await store.append_many(rollout_events(run_id, group.rollout_ids[1], "g0", 0.0, "failed"))
                break
            await asyncio.sleep(0.2)
        assert await watch.wait_groups([group], 1, timeout_s=30) == [group]
        assert watch.ended == {group.rollout_ids[0]: "succeeded", group.rollout_ids[1]: "failed"}
    finally:
        await watch.stop()
        await store.close()
