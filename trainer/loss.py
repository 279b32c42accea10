"""The policy loss, in torch: collating samples into tensors and the clipped PPO objective.

A sample is token ids plus a loss mask that is 1 only on tokens the model sampled. A causal LM's
logits at position t predict token t+1, so everything the loss needs is *target-aligned*: shape
[B, T-1], where column t is about token t+1 (`input_ids[:, 1:]`). Token 0 is always prompt.

The loss of a (micro-)batch is the plain weighted sum Σ_tokens w·mask·ℓ, where `token_weight` w
was fixed for the whole optimizer step by `trainer.core.loss_weights`. It is never divided again,
so the gradients of micro-batches add up to exactly the full step's gradient.

Per token, with ratio r = exp(logπθ - logπ_behaviour) against the behaviour logprobs the engine
recorded (which may be a few weights versions stale) and advantage A:

    ℓ = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high))            PPO clip
    ℓ = min(ℓ, -A·c)              where A < 0, if ratio_cap c  (dual clip: truncates the ratio)
    ℓ += β·(exp(ref - logπθ) - (ref - logπθ) - 1)             optional KL to a reference (k3)

The dual clip bounds what one stale token can contribute when its ratio has run off: a token whose
ratio exceeds c with a negative advantage gets no gradient instead of an unbounded one.

Run the tests with `.venv/bin/pytest tests/trainer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from trainer.core.merge import Sample
from trainer.logprobs import TokenSampling, row_settings

# exp() of a log-ratio beyond this would overflow float32 and poison the backward pass with NaN.
_MAX_LOG_RATIO = 20.0


class PolicyBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Tensors for a list of samples, in one of two layouts; the loss fields are [B, T'] and *target-aligned*.

    Padded (`collate`): one row per sample, right padding, T' = T-1: column t is about token t+1.
    Packed (`pack`): every sample in one row [1, N] back to back, `position_ids` restarting at 0 per
    sample (attention stays within a sample), T' = N: column t is about the next token of the same
    sample (a sample's last column is masked out).
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens
    loss_mask: torch.Tensor  # [B, T'] float, 1 where the target was sampled
    old_logprobs: torch.Tensor  # [B, T'] float, behaviour logprobs of the targets (0 off-mask)
    advantages: torch.Tensor  # [B, T'] float, the sample's advantage on each of its positions
    token_weight: torch.Tensor  # [B, T'] float, the sample's loss weight on each of its positions
    temperature: torch.Tensor | None = None  # [B, 1, 1] float (padded layout), each row's temperature
    targets: torch.Tensor | None = None  # [B, T'] long, the token each position predicts
    position_ids: torch.Tensor | None = None  # [1, N] long (packed layout)
    sampling: TokenSampling | None = None  # per position of [B, T'], flattened: how each target was sampled

    def to(self, device: torch.device | str) -> PolicyBatch:
        """The same batch on another device."""
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        return PolicyBatch(**{f: None if v is None else v.to(device) for f, v in fields.items()})  # type: ignore[arg-type]


class PolicyLossConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Clip range (`clip_low`, `clip_high`), dual-clip cap (`ratio_cap`, None = off), KL coefficient."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    ratio_cap: float | None = 3.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.ratio_cap is not None and self.ratio_cap <= 1.0:
            raise ValueError(f"ratio_cap must be > 1 (dual clip) or None, got {self.ratio_cap}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


class LossMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """Means over the sampled tokens of the batch (`tokens` of them), for logging.

    To combine micro-batches, weight each mean by its `tokens`. `loss` is the value returned.
    """

    loss: float
    tokens: int
    clip_fraction: float
    dual_clip_fraction: float
    ratio_mean: float
    approx_kl: float
    kl_ref: float | None = None
    entropy: float | None = None


def collate(samples: Sequence[Sample], *, pad_id: int = 0, default_temperature: float = 1.0) -> PolicyBatch:
    """Right-pad samples into a `PolicyBatch` (one row per sample, in order).

    A row's temperature is its sample's recorded sampling temperature (greedy counts as 1, as the
    engine reports it), else `default_temperature` (calls recorded without one).
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    batch, length = len(samples), max(len(s.tokens) for s in samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((batch, length), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch, length), dtype=torch.float32)  # [B, T], shifted below
    old_logprobs = torch.zeros((batch, length), dtype=torch.float32)
    advantages = torch.zeros((batch, length), dtype=torch.float32)
    token_weight = torch.zeros((batch, length), dtype=torch.float32)
    settings = [row_settings(s.temperature, s.top_p, s.top_k, default_temperature) for s in samples]
    for row, s in enumerate(samples):
        n = len(s.tokens)
        if n and s.loss_mask[0]:
            raise ValueError(f"sample {s.rollout_id}/{s.index} starts with a sampled token; it has no context")
        input_ids[row, :n] = torch.tensor(s.tokens, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old_logprobs[row, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        advantages[row, :n] = _advantages(s)
        token_weight[row, :n] = s.token_weight
    return PolicyBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask[:, 1:],  # [B, T-1]: about token t+1
        old_logprobs=old_logprobs[:, 1:],
        advantages=advantages[:, 1:],
        token_weight=token_weight[:, 1:],
        temperature=torch.tensor([t for t, _, _ in settings], dtype=torch.float32).view(-1, 1, 1),
        targets=input_ids[:, 1:],
        sampling=_per_position(settings, [length - 1] * batch),
    )


def _per_position(settings: Sequence[tuple[float, float, int]], widths: Sequence[int]) -> TokenSampling:
    """Each row's (temperature, top_p, top_k) repeated over its `widths` positions, flattened."""
    counts = torch.tensor(widths, dtype=torch.long)
    return TokenSampling(
        temperature=torch.tensor([t for t, _, _ in settings], dtype=torch.float32).repeat_interleave(counts),
        top_p=torch.tensor([p for _, p, _ in settings], dtype=torch.float32).repeat_interleave(counts),
        top_k=torch.tensor([k for _, _, k in settings], dtype=torch.long).repeat_interleave(counts),
    )


def pack(samples: Sequence[Sample], *, default_temperature: float = 1.0) -> PolicyBatch:
    """Samples back to back in one row [1, N] (the packed layout of `PolicyBatch`), no padding.

    Positions restart at 0 for each sample, which is how transformers tells packed sequences apart:
    flash-attn's varlen kernels where installed, else sdpa with a block-diagonal causal mask.
    """
    if not samples:
        raise ValueError("pack needs at least one sample")
    for s in samples:
        if len(s.tokens) and s.loss_mask[0]:
            raise ValueError(f"sample {s.rollout_id}/{s.index} starts with a sampled token; it has no context")
    lengths = [len(s.tokens) for s in samples]
    ids = torch.cat([torch.as_tensor(np.asarray(s.tokens), dtype=torch.long) for s in samples])  # [N]
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
    last = torch.tensor(lengths, dtype=torch.long).cumsum(0) - 1  # each sample's last position

    def shifted(values: list[torch.Tensor]) -> torch.Tensor:
        row = torch.roll(torch.cat(values), -1)
        row[last] = 0
        return row.unsqueeze(0)  # [1, N]

    settings = [row_settings(s.temperature, s.top_p, s.top_k, default_temperature) for s in samples]
    targets = torch.roll(ids, -1)
    targets[last] = 0
    return PolicyBatch(
        input_ids=ids.unsqueeze(0),
        attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
        position_ids=positions.unsqueeze(0),
        targets=targets.unsqueeze(0),
        loss_mask=shifted([torch.as_tensor(np.asarray(s.loss_mask), dtype=torch.float32) for s in samples]),
        old_logprobs=shifted([torch.as_tensor(np.asarray(s.logprobs), dtype=torch.float32) for s in samples]),
        advantages=shifted([torch.full((n,), 1.0) * _advantages(s) for s, n in zip(samples, lengths, strict=True)]),
        token_weight=shifted([torch.full((n,), s.token_weight) for s, n in zip(samples, lengths, strict=True)]),
        sampling=_per_position(settings, lengths),
    )


def _advantages(sample: Sample) -> float | torch.Tensor:
    """A sample's advantage on each of its tokens: its per-token advantages if set, else the scalar."""
    if sample.token_advantages is None:
        return sample.advantage
    return torch.tensor(sample.token_advantages, dtype=torch.float32)


def _row_temperature(batch: PolicyBatch) -> float | torch.Tensor:
    return 1.0 if batch.temperature is None else batch.temperature


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """Log-probability of each next token under the logits: [B, T, V] x [B, T] -> [B, T-1].

    Column t is log p(input_ids[:, t+1] | input_ids[:, :t+1]). Divide by the sampling
    `temperature` (a number, or [B, 1, 1] per row: `PolicyBatch.temperature`) so the result is
    comparable to the engine's behaviour logprobs.
    """
    shifted = logits[:, :-1, :].float() / temperature  # [B, T-1, V]
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    picked = shifted.gather(-1, targets).squeeze(-1)  # [B, T-1]
    return picked - torch.logsumexp(shifted, dim=-1)  # [B, T-1]


def token_entropy(logits: torch.Tensor, *, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Entropy of each next-token distribution: [B, T, V] -> [B, T-1] (aligned like `token_logprobs`)."""
    logp = torch.log_softmax(logits[:, :-1, :].float() / temperature, dim=-1)  # [B, T-1, V]
    return -(logp.exp() * logp).sum(-1)  # [B, T-1]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, count: int) -> float:
    return float((values * mask).sum()) / count if count else 0.0


def policy_loss(
    logprobs: torch.Tensor,
    batch: PolicyBatch,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    ref_logprobs: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """The batch's loss Σ w·mask·ℓ (a scalar to backpropagate, not averaged) and its metrics.

    `logprobs` [B, T'] are the current policy's (`trainer.forward.policy_logprobs`); `ref_logprobs`
    [B, T'] the reference model's, needed when `config.kl_coef > 0`; `entropy` [B, T'] (or
    `logits` [B, T, V] of the padded layout), if given, only feed the entropy metric.
    """
    if config.kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference model's token_logprobs)")
    mask = batch.loss_mask  # [B, T-1]
    adv = batch.advantages  # [B, T-1]
    log_ratio = (logprobs - batch.old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, T-1]
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)  # [B, T-1]
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if config.ratio_cap is not None:
        cap = -adv * config.ratio_cap
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
    kl_ref = None
    if ref_logprobs is not None:
        delta = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl_ref = delta.exp() - delta - 1.0  # [B, T-1], k3 estimator of KL(πθ || π_ref), >= 0
        if config.kl_coef > 0.0:
            per_token = per_token + config.kl_coef * kl_ref
    loss = (per_token * mask * batch.token_weight).sum()

    with torch.no_grad():
        tokens = int(mask.sum())
        metrics = LossMetrics(
            loss=loss.item(),
            tokens=tokens,
            clip_fraction=_masked_mean((clipped > unclipped).float(), mask, tokens),
            dual_clip_fraction=_masked_mean(dual.float(), mask, tokens),
            ratio_mean=_masked_mean(ratio, mask, tokens),
            approx_kl=_masked_mean(ratio - 1.0 - log_ratio, mask, tokens),
            kl_ref=None if kl_ref is None else _masked_mean(kl_ref, mask, tokens),
            entropy=_masked_mean(entropy, mask, tokens)
            if entropy is not None
            else None
            if logits is None
            else _masked_mean(token_entropy(logits, temperature=_row_temperature(batch)), mask, tokens),
        )
    return loss, metrics
