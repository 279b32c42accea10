"""Off-policy re-training: a recorded step's samples trained again, with decoupled PPO's estimator.

A recorded sample carries the behaviour policy's logprobs: those of the weights that sampled it
during the run, not those of the model being re-trained. Re-training another scheme (or from
another checkpoint) makes them off-policy, so the loss separates the two roles, as decoupled PPO
does (Hilton et al., 2021; AReaL), with the importance weight truncated (TIS):

    π_behav   the recorded logprobs (the policy that sampled the token)
    π_prox    the re-trained model before this step (one forward pass, no gradient; fixed for the step)
    π_θ       the re-trained model being optimized

    w   = min(π_prox / π_behav, C)                      truncated importance weight, per token
    r   = π_θ / π_prox                                   the ratio PPO clips
    ℓ   = w · max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high))   (dual clip and KL term as in `trainer.loss`)

Because w ≥ 0, w·max(-A·r, -A·clip(r)) = max(-(wA)·r, -(wA)·clip(r)): the backends' own loss
(`trainer.loss.policy_loss`) computes it exactly when each sample's logprobs are π_prox and its
per-token advantage (`Sample.token_advantages`) is w·A. So every backend re-trains with its
unchanged `update`; it only has to give the proximal logprobs (`token_logprobs`).

When the re-trained model is the run's own (same scheme, same checkpoint), π_prox equals the
trainer's π_θ at the step's first forward pass, w = π_prox/π_behav = the live ratio, r = 1: the
loss and its gradient are the live run's (where the live ratio was inside the clip range and w
under C), so the run's losses and weights are reproduced.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from trainer.backends.base import TrainingBackend, UpdateMetrics
from trainer.core import Sample

DEFAULT_IS_CAP = 2.0
"""C: the truncation of the importance weight π_prox / π_behav (TIS's usual value)."""

_MAX_LOG_RATIO = 20.0  # as in trainer.loss: exp() beyond it overflows float32


class ProximalBackend(TrainingBackend, Protocol):
    """A training backend that can also give per-token logprobs under its current weights."""

    def token_logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray | None]:
        """Per sample: logprob of each token (0 at t = 0), None for a sample `update` would not train."""
        ...


class BehaviourStats(msgspec.Struct, frozen=True, kw_only=True):
    """The re-trained model against the behaviour policy at the start of a step (means over sampled tokens)."""

    tokens: int
    kl_behaviour: float
    """k3 estimate of KL(π_behav ‖ π_prox): mean of r - 1 - log r, r = π_prox / π_behav."""
    is_weight_mean: float
    """Mean truncated importance weight w."""
    is_truncated_fraction: float
    """Fraction of tokens whose weight π_prox / π_behav exceeded C."""


def decoupled_samples(
    samples: Sequence[Sample], proximal: Sequence[np.ndarray | None], is_cap: float = DEFAULT_IS_CAP
) -> tuple[list[Sample], BehaviourStats]:
    """The samples the backend trains on: logprobs π_prox, per-token advantage w·A (module docstring).

    `proximal[i]` is `samples[i]`'s per-token logprobs under the re-trained model (None: a sample
    the backend does not train, kept as it is). Off the loss mask both are 0.
    """
    if is_cap <= 0.0:
        raise ValueError(f"is_cap must be positive, got {is_cap}")
    out: list[Sample] = []
    tokens, kl, weight, truncated = 0, 0.0, 0.0, 0
    for sample, prox in zip(samples, proximal, strict=True):
        if prox is None:
            out.append(sample)
            continue
        mask = np.asarray(sample.loss_mask, dtype=bool)  # [T]
        behaviour = np.asarray(sample.logprobs, dtype=np.float64)  # [T]
        prox = np.where(mask, np.asarray(prox, dtype=np.float64), 0.0)  # [T]
        log_w = np.clip(prox - behaviour, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [T], 0 off the mask
        raw = np.exp(log_w)
        w = np.minimum(raw, is_cap)
        out.append(
            msgspec.structs.replace(sample, logprobs=prox, token_advantages=np.where(mask, sample.advantage * w, 0.0))
        )
        tokens += int(mask.sum())
        kl += float((raw - 1.0 - log_w)[mask].sum())
        weight += float(w[mask].sum())
        truncated += int((raw[mask] > is_cap).sum())
    stats = BehaviourStats(
        tokens=tokens,
        kl_behaviour=kl / tokens if tokens else 0.0,
        is_weight_mean=weight / tokens if tokens else 0.0,
        is_truncated_fraction=truncated / tokens if tokens else 0.0,
    )
    return out, stats


def retrain_update(
    backend: ProximalBackend, samples: Sequence[Sample], is_cap: float = DEFAULT_IS_CAP
) -> tuple[UpdateMetrics | None, BehaviourStats, dict[str, float]]:
    """One re-trained step on `backend`: proximal logprobs, then `update` on the decoupled samples.

    Returns the update's metrics (None for a step without samples), the behaviour statistics and
    the seconds each part took (`proximal`, `update`).
    """
    times: dict[str, float] = {}
    if not samples:
        return None, BehaviourStats(tokens=0, kl_behaviour=0.0, is_weight_mean=0.0, is_truncated_fraction=0.0), times
    mark = time.monotonic()
    proximal = backend.token_logprobs(samples)
    trained, stats = decoupled_samples(samples, proximal, is_cap)
    times["proximal"] = time.monotonic() - mark
    mark = time.monotonic()
    update = backend.update(trained)
    times["update"] = time.monotonic() - mark
    return update, stats, times


def update_row(update: UpdateMetrics | None, stats: BehaviourStats) -> dict[str, float | None]:
    """A re-trained step's training columns, named as a live run's (`approx_kl` is KL to the behaviour policy).

    The backend's own `approx_kl` and `ratio_mean` are against π_prox (0 and 1 on the first
    optimizer step); they are kept as `approx_kl_proximal` and `ratio_mean_proximal`.
    """
    row: dict[str, float | None] = {
        "approx_kl": stats.kl_behaviour,
        "kl_behaviour": stats.kl_behaviour,
        "is_weight_mean": stats.is_weight_mean,
        "is_truncated_fraction": stats.is_truncated_fraction,
    }
    if update is not None:
        row |= {
            "loss": update.loss,
            "entropy": update.entropy,
            "clip_fraction": update.clip_fraction,
            "dual_clip_fraction": update.dual_clip_fraction,
            "grad_norm": update.grad_norm,
            "kl_ref": update.kl_ref,
            "approx_kl_proximal": update.approx_kl,
            "ratio_mean_proximal": update.ratio_mean,
        }
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
