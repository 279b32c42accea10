"""Schemes side by side: which rollouts gain or lose loss weight (and advantage), and by how much.

A rollout's loss weight is its share of its step's loss (Σ token_weight × response tokens over its
samples). Every scheme is compared with the first (the reference): a rollout *gains* under a
scheme when its share grows. `moved` is half the sum of the absolute changes: the fraction of the
loss mass (per step, summed over steps) that the scheme moves from some rollouts to others.
"""

from __future__ import annotations

import msgspec

from services.tools.report import SchemeReport

TOLERANCE = 1e-12
"""Relative change below which a rollout's weight counts as unchanged (floating-point noise)."""


class RolloutShift(msgspec.Struct, frozen=True, kw_only=True):
    """One rollout across schemes: its loss weight and advantage under each, and the change."""

    rollout_id: str
    group_id: str | None
    step: int | None
    reward: float
    response_tokens: int
    samples: dict[str, int]
    loss_weight: dict[str, float]
    advantage: dict[str, float | None]
    change: dict[str, float]
    """Loss weight under the scheme minus under the reference (schemes other than the reference)."""
    relative: dict[str, float | None]
    """change / reference weight (None when the reference weight is 0)."""


class Extreme(msgspec.Struct, frozen=True, kw_only=True):
    """The rollout with the largest gain or loss under a scheme."""

    rollout_id: str
    change: float
    relative: float | None


class SchemeShift(msgspec.Struct, frozen=True, kw_only=True):
    """How one scheme reweights the rollouts relative to the reference."""

    scheme: str
    gained: int
    lost: int
    unchanged: int
    moved: float
    largest_gain: Extreme | None
    largest_loss: Extreme | None


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    """Every scheme against the reference (the first), summarized and per rollout."""

    reference: str
    schemes: list[str]
    shifts: list[SchemeShift]
    rollouts: list[RolloutShift]


def compare(reports: list[SchemeReport]) -> Comparison:
    """Compare the schemes' rollouts with the first scheme's (all schemes replay the same rollouts)."""
    if len(reports) < 2:
        raise ValueError("comparing needs at least two schemes")
    reference = reports[0]
    names = [r.name for r in reports]
    per_scheme = [{row.rollout_id: row for row in r.rollouts} for r in reports]
    shifts: list[RolloutShift] = []
    for base in reference.rollouts:
        rows = [lookup[base.rollout_id] for lookup in per_scheme]
        change = {name: row.loss_weight - base.loss_weight for name, row in zip(names[1:], rows[1:], strict=True)}
        shifts.append(
            RolloutShift(
                rollout_id=base.rollout_id,
                group_id=base.group_id,
                step=base.step,
                reward=base.reward,
                response_tokens=base.response_tokens,
                samples={name: row.samples for name, row in zip(names, rows, strict=True)},
                loss_weight={name: row.loss_weight for name, row in zip(names, rows, strict=True)},
                advantage={name: row.advantage for name, row in zip(names, rows, strict=True)},
                change=change,
                relative={name: (c / base.loss_weight if base.loss_weight else None) for name, c in change.items()},
            )
        )
    return Comparison(
        reference=reference.name,
        schemes=names,
        shifts=[_summarize(name, shifts) for name in names[1:]],
        rollouts=shifts,
    )


def _summarize(name: str, shifts: list[RolloutShift]) -> SchemeShift:
    def significant(s: RolloutShift) -> bool:
        scale = max(abs(s.loss_weight[name]), abs(s.loss_weight[next(iter(s.loss_weight))]))
        return abs(s.change[name]) > TOLERANCE * max(scale, 1e-300)

    gained = [s for s in shifts if significant(s) and s.change[name] > 0]
    lost = [s for s in shifts if significant(s) and s.change[name] < 0]
    top = max(gained, key=lambda s: s.change[name], default=None)
    bottom = min(lost, key=lambda s: s.change[name], default=None)
    return SchemeShift(
        scheme=name,
        gained=len(gained),
        lost=len(lost),
        unchanged=len(shifts) - len(gained) - len(lost),
        moved=sum(abs(s.change[name]) for s in shifts) / 2,
        largest_gain=_extreme(top, name),
        largest_loss=_extreme(bottom, name),
    )


def _extreme(shift: RolloutShift | None, name: str) -> Extreme | None:
    if shift is None:
        return None
    return Extreme(rollout_id=shift.rollout_id, change=shift.change[name], relative=shift.relative[name])
