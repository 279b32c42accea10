"""Loss normalization as one weight per sample, fixed for the whole optimizer step.

The step's loss is Σ_samples w_j · Σ_{sampled tokens t of j} ℓ_t. Every normalization is a choice
of w_j (R rollouts, S samples, T tokens counted over sampled tokens only):

- `token-mean`: w_j = 1/T_step — every sampled token of the step counts the same;
- `seq-mean-token-mean`: w_j = 1/(S · T_j) — every sample counts the same;
- `rollout-mean` (default): w_j = 1/(R · T_ρ(j)) — every rollout counts the same, its tokens
  pooled over its samples, so how the merger split a rollout changes nothing.

Example: rollout A = samples of 50 and 100 tokens, B = three of 30, C = one of 40. token-mean
divides the six token-loss sums by 280; seq-mean averages the six per-sample means; rollout-mean
averages (A1+A2)/150, (B1+B2+B3)/90 and C1/40.

The weights are computed once over the whole step, before it is cut into micro-batches or spread
over data-parallel workers, and the loss is the plain weighted sum (never averaged again): so
summing micro-batch gradients gives the full-step gradient whatever the split. Samples or rollouts
without sampled tokens get weight 0 and are not counted in S or R.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from trainer.core.merge import Sample

Norm = Literal["token-mean", "seq-mean-token-mean", "rollout-mean"]
NORMS: tuple[Norm, ...] = ("token-mean", "seq-mean-token-mean", "rollout-mean")


def loss_weights(samples: Sequence[Sample], norm: Norm = "rollout-mean") -> list[float]:
    """The per-token loss weight of each sample of one optimizer step, under `norm`."""
    if norm == "token-mean":
        total = sum(s.response_tokens for s in samples)
        return [1.0 / total if s.response_tokens else 0.0 for s in samples]
    if norm == "seq-mean-token-mean":
        counted = sum(1 for s in samples if s.response_tokens)
        return [1.0 / (counted * s.response_tokens) if s.response_tokens else 0.0 for s in samples]
    if norm == "rollout-mean":
        per_rollout: dict[str, int] = {}
        for s in samples:
            per_rollout[s.rollout_id] = per_rollout.get(s.rollout_id, 0) + s.response_tokens
        rollouts = sum(1 for tokens in per_rollout.values() if tokens)
        return [1.0 / (rollouts * per_rollout[s.rollout_id]) if s.response_tokens else 0.0 for s in samples]
    raise ValueError(f"loss normalization {norm!r} is not one of {', '.join(NORMS)}")
