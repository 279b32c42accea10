"""A training sample as a row of counts: what the trainer writes per step and `rollwire replay` reports.

One definition, so a step's `samples/step-N.jsonl` and a replay of that step name and compute
every field the same way.
"""

from __future__ import annotations

import msgspec

from trainer.core.merge import Sample


class SampleRow(msgspec.Struct, kw_only=True):
    """One training sample: its size, reward, advantage and the loss weight of each response token."""

    rollout_id: str
    group_id: str | None
    step: int | None
    index: int
    prompt_tokens: int
    """Tokens of the sample the model did not sample (the first prompt and every observation)."""
    response_tokens: int
    """Sampled tokens: the ones the loss is computed on."""
    calls: int
    reward: float
    advantage: float
    token_weight: float = 0.0
    """The weight each of its response tokens gets in the step's loss."""


def sample_row(
    sample: Sample, *, step: int | None, reward: float, advantage: float, token_weight: float = 0.0
) -> SampleRow:
    """The row of a sample (its token lists reduced to counts)."""
    return SampleRow(
        rollout_id=sample.rollout_id,
        group_id=sample.group_id,
        step=step,
        index=sample.index,
        prompt_tokens=len(sample.tokens) - sample.response_tokens,
        response_tokens=sample.response_tokens,
        calls=sample.num_calls,
        reward=reward,
        advantage=advantage,
        token_weight=token_weight,
    )
