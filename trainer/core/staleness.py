"""Off-policy control for asynchronous training: drop calls sampled on weights too old to train on."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from schemas import events
from trainer.core.calls import RolloutCalls

TRAIN_STEP_EVENT = events.TRAIN_STEP_EVENT
"""Name of the `CustomEvent` the trainer records on each rollout it trains, payload
`{"step", "weights_version", "max_staleness", "adapter"}`: what a replay needs to rebuild that step
(reserved: an agent cannot write one)."""


def drop_stale_calls(
    rollouts: Sequence[RolloutCalls], version: int, max_staleness: int
) -> tuple[list[RolloutCalls], int]:
    """Rollouts without the calls made more than `max_staleness` versions before `version`.

    Dropping a call (rather than a merged sample) keeps merging exact: a later call's prompt still
    holds the dropped response, which then becomes context with loss mask 0. Calls without a
    recorded version are kept. Returns the rollouts and how many calls were dropped. The live
    trainer and the replay both call this, with the version and limit the trainer recorded.
    """
    kept: list[RolloutCalls] = []
    dropped = 0
    for rollout in rollouts:
        fresh = [c for c in rollout.calls if c.weights_version is None or version - c.weights_version <= max_staleness]
        dropped += len(rollout.calls) - len(fresh)
        kept.append(rollout if len(fresh) == len(rollout.calls) else msgspec.structs.replace(rollout, calls=fresh))
    return kept, dropped
