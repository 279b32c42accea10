"""The replay report: a past run's samples, advantages and loss weights under one or more schemes.

Everything that decides a number here is the trainer's adapter (`trainer.core`): each unit (one
group of one step) goes through `merge_rollouts` and `rollout_advantages`, and each step's samples
through `loss_weights`, the very functions `build_step` chains. What this module adds is the
bookkeeping that lets a run be replayed one group at a time: a sample is kept as a row of counts
(its token lists are dropped as soon as the group is done), and the loss weights, which need the
step's totals, are computed from those rows once every group is in. `loss_weights` only reads a
sample's rollout and response-token count, so the rows give it exactly what the full samples would.

The summary's fields are named and computed as the trainer's `StepStats`; for a one-step replay
they are equal to the stats the trainer logged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence

import msgspec

from services.tools.schemes import Scheme
from trainer.core import (
    AdapterConfig,
    Drops,
    MergedRollout,
    RolloutCalls,
    Sample,
    SampleRow,
    StepFigures,
    loss_weights,
    merge_rollouts,
    merge_settings,
    rollout_advantages,
    sample_row,
)


class RolloutRow(msgspec.Struct, kw_only=True):
    """One rollout: its reward and advantage, its samples, and its share of the step's loss."""

    rollout_id: str
    group_id: str | None
    step: int | None
    reward: float
    advantage: float | None
    """The advantage its samples carry (None when it has no sample)."""
    samples: int
    calls: int
    response_tokens: int
    tokens: int
    loss_weight: float = 0.0
    """Σ over its samples of token_weight × response_tokens: its share of the step's loss."""


class GroupRow(msgspec.Struct, frozen=True, kw_only=True):
    """One group of one step: its baseline under the scheme and how many samples share it."""

    group_id: str
    step: int | None
    rollouts: int
    samples: int
    baseline: float


class ReplaySummary(StepFigures, frozen=True, kw_only=True):
    """The replay's figures: the trainer's (`StepFigures`) over the whole run, and how they spread."""

    rollouts_skipped: dict[str, int]
    """Rollouts that give no training data, by the adapter's reason (not-succeeded, val-mode, ...)."""
    steps: list[int]
    samples_per_rollout: dict[str, int]
    """Distribution: number of samples → number of rollouts with that many (keys are strings in JSON)."""


class SchemeReport(msgspec.Struct, frozen=True, kw_only=True):
    """A run replayed under one scheme."""

    name: str
    config: AdapterConfig
    summary: ReplaySummary
    groups: list[GroupRow]
    rollouts: list[RolloutRow]
    samples: list[SampleRow]


_EMPTY: list[int] = []


class UnitRows(msgspec.Struct, kw_only=True):
    """One unit (a group of a step) replayed under one scheme: its rows and counters, no tokens.

    Small and picklable, so a unit can be built in a worker process and accumulated in the main one.
    """

    rollouts: list[RolloutRow]
    samples: list[list[SampleRow]]
    """Per rollout (same order as `rollouts`), its samples."""
    groups: list[GroupRow]
    dropped: int
    deduped: int
    too_long: int
    min_version: int | None
    max_version: int | None
    skipped: dict[str, str] = {}
    """Rollouts of the unit the adapter could not take (`malformed-call`)."""
    counts: dict[str, int] = {}
    """The failure rule's and the selection's counters (`StepStats` names)."""


def unit_rows(
    step: int | None,
    rollouts: Sequence[RolloutCalls],
    configs: Sequence[AdapterConfig],
    skipped: Mapping[str, str] | None = None,
) -> list[UnitRows]:
    """Merge one unit's rollouts and give them their advantages under each config: the adapter's
    functions, then rows (one `UnitRows` per config).

    The rollouts are merged once per distinct `merge_settings`: schemes compared on advantages or
    loss normalization share the merge, most of a unit's cost.
    """
    merges: dict[Hashable, tuple[list[MergedRollout], Drops]] = {}
    out = []
    for config in configs:
        key = merge_settings(config)
        if key not in merges:
            merges[key] = merge_rollouts(rollouts, config)
        out.append(_rows(step, *merges[key], config, skipped))
    return out


def _rows(
    step: int | None,
    merged: list[MergedRollout],
    drops: Drops,
    config: AdapterConfig,
    skipped: Mapping[str, str] | None,
) -> UnitRows:
    advantages, baselines = rollout_advantages(merged, config)
    rollout_rows: list[RolloutRow] = []
    sample_rows: list[list[SampleRow]] = []
    versions: list[int] = []
    for m, per_sample in zip(merged, advantages, strict=True):
        rows = [
            sample_row(s, step=step, reward=m.reward, advantage=a) for s, a in zip(m.samples, per_sample, strict=True)
        ]
        sample_rows.append(rows)
        rollout_rows.append(
            RolloutRow(
                rollout_id=m.rollout_id,
                group_id=m.group_id,
                step=step,
                reward=m.reward,
                advantage=per_sample[0] if per_sample else None,
                samples=len(rows),
                calls=m.calls,
                response_tokens=sum(r.response_tokens for r in rows),
                tokens=m.tokens,
            )
        )
        versions.extend(v for s in m.samples for v in (s.min_weights_version, s.max_weights_version) if v is not None)
    groups = []
    for group_id, baseline in baselines.items():
        members = [m for m in merged if m.group_id == group_id]
        groups.append(
            GroupRow(
                group_id=group_id,
                step=step,
                rollouts=len(members),
                samples=sum(len(m.samples) for m in members),
                baseline=baseline,
            )
        )
    return UnitRows(
        rollouts=rollout_rows,
        samples=sample_rows,
        groups=groups,
        dropped=drops.no_reward,
        counts={
            "calls_context": sum(m.calls_context for m in merged),
            "rollouts_failed_scored": sum(1 for m in merged if m.failure is not None),
            "rollouts_failed_dropped": drops.failed,
            "groups_skipped": drops.groups_skipped,
            "rollouts_in_skipped_groups": drops.in_skipped_groups,
        },
        deduped=sum(m.calls_deduped for m in merged),
        too_long=sum(m.calls_too_long for m in merged),
        min_version=min(versions, default=None),
        max_version=max(versions, default=None),
        skipped=dict(skipped or {}),
    )


class SchemeAccumulator:
    """Collects a scheme's units one at a time; `finish` computes the loss weights and figures."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.config = scheme.config
        self.rollouts: list[tuple[int, RolloutRow]] = []
        self.samples: dict[str, list[SampleRow]] = {}
        self.groups: list[tuple[int, GroupRow]] = []
        self.dropped = 0
        self.deduped = 0
        self.too_long = 0
        self.versions: list[int] = []
        self.skipped: dict[str, str] = {}
        self.counts: Counter[str] = Counter()

    def add_rows(self, unit: UnitRows, order: Mapping[str, int]) -> None:
        """Collect a unit replayed by `unit_rows` (here or in a worker)."""
        for row, samples in zip(unit.rollouts, unit.samples, strict=True):
            self.rollouts.append((order[row.rollout_id], row))
            self.samples[row.rollout_id] = samples
        first = min((order[row.rollout_id] for row in unit.rollouts), default=0)
        self.groups.extend((first, group) for group in unit.groups)
        self.dropped += unit.dropped
        self.deduped += unit.deduped
        self.too_long += unit.too_long
        self.skipped.update(unit.skipped)
        self.counts.update(unit.counts)
        self.versions.extend(v for v in (unit.min_version, unit.max_version) if v is not None)
        if len(self.versions) > 2:
            self.versions = [min(self.versions), max(self.versions)]

    def finish(self, skipped: Mapping[str, str]) -> SchemeReport:
        """Loss weights per step (from the rows, by `loss_weights`), rows in run order, and the figures."""
        self.rollouts.sort(key=lambda pair: pair[0])
        self.groups.sort(key=lambda pair: pair[0])
        rollouts = [row for _, row in self.rollouts]
        by_step: dict[int | None, list[SampleRow]] = {}
        for row in rollouts:
            by_step.setdefault(row.step, []).extend(self.samples[row.rollout_id])
        for step_rows in by_step.values():
            for sample, weight in zip(step_rows, loss_weights(_as_samples(step_rows), self.config.norm), strict=True):
                sample.token_weight = weight
        samples = [s for row in rollouts for s in self.samples[row.rollout_id]]
        for row in rollouts:
            row.loss_weight = sum(s.token_weight * s.response_tokens for s in self.samples[row.rollout_id])
        return SchemeReport(
            name=self.scheme.name,
            config=self.config,
            summary=self._summary(rollouts, samples, {**skipped, **self.skipped}),
            groups=[group for _, group in self.groups],
            rollouts=rollouts,
            samples=samples,
        )

    def _summary(
        self, rollouts: list[RolloutRow], samples: list[SampleRow], skipped: Mapping[str, str]
    ) -> ReplaySummary:
        counts = [r.samples for r in rollouts]
        merged_calls = sum(s.calls for s in samples)
        return ReplaySummary(
            rollouts=len(rollouts),
            rollouts_skipped=dict(sorted(Counter(skipped.values()).items())),
            rollouts_dropped_no_reward=self.dropped,
            rollouts_without_samples=sum(1 for c in counts if c == 0),
            ungrouped_rollouts=sum(1 for r in rollouts if r.group_id is None),
            groups=len({r.group_id for r in rollouts if r.group_id is not None}),
            steps=sorted({r.step for r in rollouts if r.step is not None}),
            calls=sum(r.calls for r in rollouts),
            calls_deduped=self.deduped,
            calls_too_long=self.too_long,
            samples=len(samples),
            merge_ratio=merged_calls / len(samples) if samples else 0.0,
            samples_per_rollout_mean=len(samples) / len(rollouts) if rollouts else 0.0,
            samples_per_rollout_max=max(counts, default=0),
            samples_per_rollout={str(k): v for k, v in sorted(Counter(counts).items())},
            single_sample_rollouts=sum(1 for c in counts if c == 1),
            tokens=sum(r.tokens for r in rollouts),
            response_tokens=sum(s.response_tokens for s in samples),
            reward_mean=sum(r.reward for r in rollouts) / len(rollouts) if rollouts else 0.0,
            min_weights_version=min(self.versions, default=None),
            max_weights_version=max(self.versions, default=None),
            calls_context=self.counts["calls_context"],
            rollouts_failed_scored=self.counts["rollouts_failed_scored"],
            rollouts_failed_dropped=self.counts["rollouts_failed_dropped"],
            groups_skipped=self.counts["groups_skipped"],
            rollouts_in_skipped_groups=self.counts["rollouts_in_skipped_groups"],
        )


def _as_samples(rows: Iterable[SampleRow]) -> list[Sample]:
    """Token-less stand-ins for `loss_weights`, which reads only the rollout and response-token count."""
    return [
        Sample(
            rollout_id=r.rollout_id,
            group_id=r.group_id,
            index=r.index,
            tokens=_EMPTY,
            loss_mask=_EMPTY,
            logprobs=[],
            call_ids=[],
            response_tokens=r.response_tokens,
        )
        for r in rows
    ]
