"""Rollouts lost to a crash are launched again when the run resumes, not charged to the step.

After a full crash (trainer, controller and their executions gone at once) the controller, once
back, ends every execution it no longer has as `failed` with the cause `infrastructure` (its
supervisor died, or it vanished). Those are the rollouts the step was waiting for; dropping them
all would leave the step nothing to train on. So during the first step after a resume, a rollout
of the step's groups that ended that way is declared again, once, under a new id
(`{id}-relaunched`) with the same task and group, and the group waits for it. Rollouts that
finished before the crash are re-collected as they are; a relaunched one that fails again is
dropped as any infrastructure failure is.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import msgspec

from services.common.eventstore import EventStore
from trainer.checkpoint import InFlightGroup
from trainer.clients import GatewayClient, NewRollout
from trainer.rollouts import StatusWatch

SUFFIX = "-relaunched"


async def lost_rollouts(store: EventStore, run_id: str, rollout_ids: Collection[str]) -> set[str]:
    """The rollouts among `rollout_ids` whose last status is `failed` with the cause `infrastructure`."""
    lost = set()
    for rollout_id in rollout_ids:
        if rollout_id.endswith(SUFFIX):
            continue  # launched again once already
        last, _ = await store.last_status(run_id, rollout_id)
        if last is not None and last.status == "failed" and last.cause == "infrastructure":
            lost.add(rollout_id)
    return lost


async def relaunch(
    gateway: GatewayClient,
    run_id: str,
    step: int,
    groups: Sequence[InFlightGroup],
    lost: Collection[str],
    task_input: Callable[[int], Any],
) -> list[InFlightGroup]:
    """`groups` with each `lost` rollout replaced by a newly declared one (same task and group)."""
    out: list[InFlightGroup] = []
    declared: list[NewRollout] = []
    for group in groups:
        ids = [f"{r}{SUFFIX}" if r in lost else r for r in group.rollout_ids]
        declared += [
            NewRollout(
                rollout_id=f"{r}{SUFFIX}",
                group_id=group.group_id,
                input=task_input(group.task_index),
                metadata={"task_index": group.task_index, "step": step, "group_size": len(ids), "relaunch_of": r},
            )
            for r in group.rollout_ids
            if r in lost
        ]
        out.append(msgspec.structs.replace(group, rollout_ids=ids) if ids != group.rollout_ids else group)
    if declared:
        await gateway.create_rollouts(run_id, declared, key=f"{run_id}-relaunch-{declared[0].rollout_id}")
    return out


async def wait_relaunching(
    watch: StatusWatch,
    store: EventStore,
    gateway: GatewayClient,
    run_id: str,
    step: int,
    in_flight: list[InFlightGroup],
    need: int,
    suspect: set[str],
    task_input: Callable[[int], Any],
) -> tuple[list[InFlightGroup], list[InFlightGroup]]:
    """`watch.wait_groups(in_flight, need)`, relaunching `suspect` rollouts lost to a crash (module
    docstring) and waiting for them too; returns (in_flight, ended)."""
    ended = await watch.wait_groups(in_flight, need)
    while suspect:
        finished = [r for g in ended for r in g.rollout_ids if r in suspect]
        lost = await lost_rollouts(store, run_id, finished)
        suspect.difference_update(finished)
        if not lost:
            break
        in_flight = await relaunch(gateway, run_id, step, in_flight, lost, task_input)
        ended = await watch.wait_groups(in_flight, need)
    return in_flight, ended
