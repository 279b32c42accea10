"""Group-relative advantages: a reward minus a baseline from the other members of its group.

The reward belongs to the rollout, so the unit of the statistics is the rollout: one reward per
rollout, groups are the rollouts of one task (same group id), and every sample of a rollout
inherits its rollout's advantage. Computing the statistics over samples instead (as frameworks that
split a trajectory into per-turn samples do) weighs a rollout by how many samples the merger made
of it: one group, rollout 1 with reward 1 in 3 samples and rollout 2 with reward 0 in 1 sample,
has the rollout-level baseline 1/2 but the sample-level one 3/4. The functions here take any unit
(one entry per rollout, or per sample), so both can be computed and compared.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal

Estimator = Literal["grpo", "rloo"]


def _members(groups: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    members: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    return members


def group_baselines(rewards: Sequence[float], groups: Sequence[Hashable]) -> dict[Hashable, float]:
    """The mean reward of each group (the GRPO baseline), keyed by group."""
    return {g: sum(rewards[i] for i in idx) / len(idx) for g, idx in _members(groups).items()}


def group_advantages(
    rewards: Sequence[float],
    groups: Sequence[Hashable],
    *,
    estimator: Estimator = "grpo",
    scale_std: bool = False,
    eps: float = 1e-6,
) -> list[float]:
    """One advantage per entry: its reward minus its group's baseline, optionally over the group std.

    `grpo`: baseline = the group mean (the entry included). `rloo`: baseline = the mean of the
    *other* members (leave-one-out), i.e. (n/(n-1))·(r - mean). A group of one has advantage 0
    under both. `scale_std` divides by the group's sample standard deviation (n-1 in the
    denominator, 0 for a group of one) plus `eps`, so a group whose rewards are all equal gets 0.
    """
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids; give one group id per reward")
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"advantage estimator {estimator!r} is not one of 'grpo', 'rloo'")
    advantages = [0.0] * len(rewards)
    for idx in _members(groups).values():
        n = len(idx)
        if n == 1:
            continue
        values = [rewards[i] for i in idx]
        mean = sum(values) / n
        scale = 1.0
        if scale_std:
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
            scale = 1.0 / (std + eps)
        for i, value in zip(idx, values, strict=True):
            centred = value - mean if estimator == "grpo" else (value - mean) * n / (n - 1)
            advantages[i] = centred * scale
    return advantages
