"""The validation pass: held-out tasks run in `val` mode through the same harness, never trained on.

Every `[validation] every` steps, after the step's new weights are served, each task of the
validation set runs `rollouts_per_task` times as `val` rollouts (the proxy records their calls in
`val` mode; the adapter never takes them). The pass waits for them on the same status watch as
training rollouts and reports their mean reward as `val/reward` (CSV, TensorBoard, step line).
A rollout the policy made fail scores `failed_reward`, as in training; one the infrastructure
failed is left out. Rollout ids follow from the run and the step, so a resumed run re-adopts them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import Event, RewardReported, RolloutStatusChanged
from services.common.eventstore import EventStore
from services.common.gateway_api import GatewayClient, NewRollout
from trainer.checkpoint import InFlightGroup
from trainer.core import AdapterConfig, failure_kind
from trainer.dataset import load_jsonl
from trainer.rollouts import StatusWatch
from trainer.run.sections import ValidationSection

if TYPE_CHECKING:
    from trainer.metrics import MetricsLog

VAL_REWARD = "val/reward"
Pass = tuple[int, float]


def first_and_last_pass(log: MetricsLog) -> tuple[Pass, Pass] | None:
    """The (step, held-out reward) of the run's first and last validation passes, if two or more ran."""
    steps, held = log.series(VAL_REWARD)
    if len(held) < 2:
        return None
    return (steps[0], held[0]), (steps[-1], held[-1])


def val_reward(events: Sequence[Event], adapter: AdapterConfig) -> float | None:
    """A `val` rollout's reward: its succeeded attempt's last reward, `failed_reward` for a policy failure."""
    final: RolloutStatusChanged | None = None
    for event in events:
        if isinstance(event, RolloutStatusChanged):
            final = event
    if final is None:
        return None
    if final.status != "succeeded":
        kind = failure_kind(final.status, final.reason, cause=final.cause)
        return adapter.failure_reward() if kind not in (None, "infrastructure") else None
    rewards = [e.value for e in events if isinstance(e, RewardReported) and e.attempt_id in (final.attempt_id, None)]
    return rewards[-1] if rewards else adapter.fill_reward()


class ValidationPass:
    """Runs the pass of the module docstring for one run."""

    def __init__(self, section: ValidationSection, run_id: str, adapter: AdapterConfig) -> None:
        self.section = section
        self.run_id = run_id
        self.adapter = adapter
        tasks = load_jsonl(Path(section.path))
        self.tasks = tasks[: section.max_tasks] if section.max_tasks else tasks

    def due(self, step: int) -> bool:
        """Whether the pass runs after `step`."""
        return step % self.section.every == 0

    def groups(self, step: int) -> list[InFlightGroup]:
        """The pass's groups after `step`: one per task, ids derived from the run and the step."""
        return [
            InFlightGroup(
                group_id=f"{self.run_id}-val{step}-t{i}",
                rollout_ids=[f"{self.run_id}-val{step}-t{i}-r{j}" for j in range(self.section.rollouts_per_task)],
                task_index=i,
                created_version=0,
            )
            for i in range(len(self.tasks))
        ]

    async def run(self, step: int, gateway: GatewayClient, watch: StatusWatch, store: EventStore) -> dict[str, Any]:
        """Declare the pass, wait for it, and return `{"val/reward": mean, "val_rollouts": n}`."""
        groups = self.groups(step)
        declared = [
            NewRollout(
                rollout_id=rid,
                group_id=g.group_id,
                input=self.tasks[g.task_index],
                mode="val",
                metadata={"task_index": g.task_index, "step": step, "validation": True},
            )
            for g in groups
            for rid in g.rollout_ids
        ]
        for record in await gateway.create_rollouts(self.run_id, declared, key=f"{self.run_id}-val-{step}"):
            if record.get("state") in ("succeeded", "failed", "cancelled"):
                watch.ended[str(record["rollout_id"])] = str(record["state"])
        await watch.wait_groups(groups, len(groups))
        rewards: list[float] = []
        for group in groups:
            for rid in group.rollout_ids:
                events = [stored.event for stored in await store.read_rollout(self.run_id, rid)]
                reward = val_reward(events, self.adapter)
                if reward is not None:
                    rewards.append(reward)
        return {VAL_REWARD: statistics.fmean(rewards) if rewards else None, "val_rollouts": len(rewards)}
