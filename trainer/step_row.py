"""One step's metrics as one row of `metrics.csv` (the columns are `trainer.metrics.COLUMNS`).

The row holds the step's counts (rollouts, groups, samples, calls, tokens), its reward and
advantage figures, the update's figures, the means of the agents' own metrics (`agent_<name>`),
what the failure rule did (rollouts a policy failure scored or dropped, infrastructure failures
dropped) and the time each phase took.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from trainer.backends.base import UpdateMetrics
from trainer.core import AdapterConfig, RolloutCalls, StepBatch, rollout_reward
from trainer.metrics import UPDATE_COLUMNS
from trainer.rollouts import ReplayedGroup

Row = dict[str, Any]


def _stats(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and population standard deviation (None for no values)."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def _agent_row(replayed: Sequence[ReplayedGroup]) -> Row:
    """The mean of each metric the agents reported (custom events), as `agent_<name>` columns."""
    agent: dict[str, list[float]] = {}
    for group in replayed:
        for found in group.agent_metrics:
            for key, value in found.items():
                agent.setdefault(key, []).append(value)
    return {f"agent_{key}": statistics.fmean(values) for key, values in sorted(agent.items())}


def step_row(
    step: int,
    version: int,
    replayed: Sequence[ReplayedGroup],
    batch: StepBatch,
    stale_dropped: int,
    trained_version: int,
    update: UpdateMetrics | None,
    times: dict[str, float],
    adapter: AdapterConfig | None = None,
) -> Row:
    """The metrics of one step, as one row of the CSV (see `trainer.metrics.COLUMNS`)."""
    stats = batch.stats
    rollouts = [r for g in replayed for r in g.rollouts]
    failed = sum(len(g.skipped) for g in replayed)
    rewards = [r.reward for r in rollouts if r.reward is not None]
    per_rollout = {s.rollout_id: s.advantage for s in batch.samples}
    adv_mean, adv_std = _stats(list(per_rollout.values()))
    reward_mean, reward_std = _stats(rewards)
    low = stats.min_weights_version
    row: Row = {
        "step": step,
        "weights_version": version,
        "rollouts": len(rollouts) + failed,
        "rollouts_failed": failed,
        "groups": len(replayed),
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "advantage_mean": adv_mean,
        "advantage_std": adv_std,
        "advantage_abs_mean": statistics.fmean(abs(a) for a in per_rollout.values()) if per_rollout else None,
        "samples": stats.samples,
        "samples_per_rollout": stats.samples_per_rollout_mean,
        "samples_per_rollout_max": stats.samples_per_rollout_max,
        "rollouts_single_sample": stats.single_sample_rollouts,
        "merge_ratio": stats.merge_ratio,
        "calls": stats.calls,
        "calls_stale_dropped": stale_dropped,
        "staleness_max": trained_version - low if low is not None else None,
        "tokens": stats.tokens,
        "response_tokens": stats.response_tokens,
    }
    if update is not None:
        row |= {name: getattr(update, name) for name in UPDATE_COLUMNS}
    row |= _agent_row(replayed)
    row |= _failure_row(rollouts, [r for g in replayed for r in g.skipped.values()], batch, adapter or AdapterConfig())
    row |= {f"time_{name}_s": round(seconds, 4) for name, seconds in times.items()}
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _failure_row(
    rollouts: Sequence[RolloutCalls], skipped: Sequence[str], batch: StepBatch, adapter: AdapterConfig
) -> Row:
    """The failure rule's figures of a step, and the reward mean counting scored failures."""
    rewards = [r for r in (rollout_reward(x, adapter) for x in rollouts) if r is not None]
    stats = batch.stats
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else (0.0 if rewards else None),
        "rollouts_failed_scored": stats.rollouts_failed_scored,
        "rollouts_failed_dropped": stats.rollouts_failed_dropped,
        "rollouts_infra_dropped": sum(1 for reason in skipped if reason == "infrastructure"),
        "groups_skipped": stats.groups_skipped,
        "calls_context": stats.calls_context,
        "calls_deduped": stats.calls_deduped,
    }
