"""The trainer's adapter: pure functions from recorded model calls to weighted training samples.

    events ─► rollout_calls ─► dedup_calls ─► merge_calls ─► group_advantages ─► loss_weights
                                    └──────────── build_step / build_steps ──────────────┘

No I/O and no torch here: the live trainer and the replay tool feed the same functions the same
`RolloutCalls` and `AdapterConfig`, so a past run's samples can be recomputed under another scheme.
"""

from schemas.calls import CallRecord
from trainer.core.advantages import Estimator, group_advantages, group_baselines
from trainer.core.batching import pack_bins, partition_balanced, plan_micro_batches, plan_steps
from trainer.core.calls import (
    SKIP_REASONS,
    CollectedRollouts,
    NotTrainable,
    RolloutCalls,
    Selection,
    collect_rollouts,
    events_by_rollout,
    rollout_calls,
)
from trainer.core.config import AdapterConfig, AdapterConfigError, AdvantageLevel
from trainer.core.dedup import dedup_calls
from trainer.core.failures import POLICY_FAILURES, FailureKind, failure_kind
from trainer.core.merge import MergeMode, MergeResult, Sample, merge_calls
from trainer.core.recorded import CallTokens, MalformedCall, call_from_event, context_call
from trainer.core.rows import SampleRow, sample_row
from trainer.core.staleness import TRAIN_STEP_EVENT, drop_stale_calls
from trainer.core.step import (
    Drops,
    MergedRollout,
    StepBatch,
    StepFigures,
    StepStats,
    build_step,
    build_steps,
    merge_rollout,
    merge_rollouts,
    merge_settings,
    rollout_advantages,
    rollout_reward,
)
from trainer.core.tokens import as_floats, as_ids, plain, same_ids
from trainer.core.weights import NORMS, Norm, loss_weights

__all__ = [
    "NORMS",
    "POLICY_FAILURES",
    "SKIP_REASONS",
    "TRAIN_STEP_EVENT",
    "AdapterConfig",
    "AdapterConfigError",
    "AdvantageLevel",
    "CallRecord",
    "CallTokens",
    "CollectedRollouts",
    "Drops",
    "Estimator",
    "FailureKind",
    "MalformedCall",
    "MergeMode",
    "MergeResult",
    "MergedRollout",
    "Norm",
    "NotTrainable",
    "RolloutCalls",
    "Sample",
    "SampleRow",
    "Selection",
    "StepBatch",
    "StepFigures",
    "StepStats",
    "as_floats",
    "as_ids",
    "build_step",
    "build_steps",
    "call_from_event",
    "collect_rollouts",
    "context_call",
    "dedup_calls",
    "drop_stale_calls",
    "events_by_rollout",
    "failure_kind",
    "group_advantages",
    "group_baselines",
    "loss_weights",
    "merge_calls",
    "merge_rollout",
    "merge_rollouts",
    "merge_settings",
    "pack_bins",
    "partition_balanced",
    "plain",
    "plan_micro_batches",
    "plan_steps",
    "rollout_advantages",
    "rollout_calls",
    "rollout_reward",
    "same_ids",
    "sample_row",
]
