"""Token logprobs and entropies from a causal LM's last hidden states, in chunks of the sequence.

Why chunks. The logits of a whole sequence in float32 are tokens x vocabulary x 4 bytes: 16,384 x
151,936 x 4 B is 10 GB, before the copies `log_softmax` and its backward make. `head_logprobs`
runs the output projection, the temperature, the nucleus filter, one `log_softmax` and one
`gather` on `chunk_tokens` positions at a time, under activation checkpointing: the backward pass
recomputes a chunk's logits instead of keeping them. The peak is one chunk's logits (1,024 x
151,936 x 4 B = 0.6 GB), and the Python calls per micro-batch are a few per chunk, never one per
token (verl's `logprobs_from_logits_v2` loops over every row when flash-attn's cross entropy is
not installed: 16,384 `log_softmax` calls for 16,384 tokens).

Only the positions that are asked for are computed (`select`): the sampled tokens, whose
logprobs the loss reads; prompt and observation positions get 0.

What distribution. The engine reports each sampled token's logprob under the distribution it was
drawn from (vLLM's `processed_logprobs`, `vllm/v1/sample/sampler.py`, which
`tests/reference_sampler.py` follows): logits over the temperature (1 when greedy), then top-k,
then top-p truncation, then `log_softmax`. The loss must recompute exactly that, per token
(`TokenSampling`: one temperature, top_p and top_k per position, from each sample's recorded
calls): on policy the ratio is then 1 for every token, whatever the sampling settings. Without
the nucleus, a token's ratio is its nucleus mass (0.8 at top_p 0.8, at the clip edge). Tokens
outside the recomputed nucleus (possible off policy) get a logprob of about -1e30: their ratio is
0 and the clip gives them no gradient.

`returning_hidden` makes a model's forward return its last hidden states instead of logits (the
output projection is applied here, by chunks); `computing_in_head` runs `head_logprobs` inside
the output projection's own call, for FSDP, whose sharded weights are whole only during it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import torch
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 1024
_OUTSIDE = -1e30  # logit of a token outside the nucleus: exp() is 0, and 0 * it is 0 (entropy), unlike -inf


class TokenSampling(msgspec.Struct, frozen=True, kw_only=True):
    """How each position's token was sampled: [N] temperature (> 0), top_p (1: off), top_k (<= 0: off)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor

    @staticmethod
    def uniform(count: int, temperature: float = 1.0, device: torch.device | str = "cpu") -> TokenSampling:
        """`count` positions sampled alike (plain sampling at `temperature`)."""
        return TokenSampling(
            temperature=torch.full((count,), temperature, device=device),
            top_p=torch.ones(count, device=device),
            top_k=torch.zeros(count, dtype=torch.long, device=device),
        )

    def take(self, index: torch.Tensor) -> TokenSampling:
        """The settings of some positions (a bool mask or indices)."""
        return TokenSampling(temperature=self.temperature[index], top_p=self.top_p[index], top_k=self.top_k[index])

    def to(self, device: torch.device | str) -> TokenSampling:
        """The same settings on another device."""
        return TokenSampling(
            temperature=self.temperature.to(device), top_p=self.top_p.to(device), top_k=self.top_k.to(device)
        )


def row_settings(
    temperature: float | None, top_p: float | None, top_k: int | None, default_temperature: float
) -> tuple[float, float, int]:
    """A sample's (temperature, top_p, top_k) as the loss applies them: greedy counts as temperature 1
    (as the engine reports it), unrecorded as `default_temperature`; top_p/top_k off are 1.0/0."""
    t = default_temperature if temperature is None else temperature if temperature > 0.0 else 1.0
    p = 1.0 if top_p is None or top_p >= 1.0 or top_p <= 0.0 else float(top_p)
    k = 0 if top_k is None or top_k <= 0 else int(top_k)
    return t, p, k


def nucleus_outside(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor | None:
    """Which tokens fall outside each row's nucleus: [C, V] logits over the temperature -> [C, V] bool.

    Top-k first (the k largest), then top-p on what is left: the smallest set of most likely tokens
    whose mass reaches p (at least one), as the engine samples. None when no row truncates.
    """
    rows = ((top_p < 1.0) | (top_k > 0)).nonzero().squeeze(-1)  # [R]
    if rows.numel() == 0:
        return None
    vocab = scaled.shape[-1]
    ordered, order = scaled[rows].sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k[rows] > 0, top_k[rows], vocab)  # [R]
    cut = rank.unsqueeze(0) >= k.unsqueeze(-1)  # [R, V]: beyond top-k
    probs = torch.softmax(ordered.masked_fill(cut, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    cut |= before >= top_p[rows].unsqueeze(-1)
    cut[:, 0] = False
    outside = torch.zeros(scaled.shape, dtype=torch.bool, device=scaled.device)
    outside[rows] = torch.zeros_like(cut).scatter(-1, order, cut)
    return outside


Pair = tuple[torch.Tensor, torch.Tensor]


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
) -> Pair:
    """One chunk: [C, H] hidden -> ([C] logprob of each target, [C] entropy, no gradient)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()  # [C, V]
    scaled = logits / temperature.unsqueeze(-1)
    outside = nucleus_outside(scaled.detach(), top_p, top_k)
    if outside is not None:
        scaled = scaled.masked_fill(outside, _OUTSIDE)
    logp = torch.log_softmax(scaled, dim=-1)  # [C, V]
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [C]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # [C]
    return picked, entropy


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    sampling: TokenSampling,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy [N] of each target under the output projection `head` of hidden states [N, H].

    Position i: log p(targets[i]) under `sampling`'s distribution at i (module docstring).
    Chunks of `chunk_tokens` positions, each recomputed in the backward pass (activation checkpointing).
    """
    weight: torch.Tensor = head.weight  # type: ignore[assignment]
    bias: torch.Tensor | None = getattr(head, "bias", None)
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        args = (
            hidden[part],
            weight,
            bias,
            targets[part],
            sampling.temperature[part],
            sampling.top_p[part],
            sampling.top_k[part],
        )
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            picked, entropy = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            picked, entropy = _chunk(*args)
        logprobs.append(picked)
        entropies.append(entropy)
    if not logprobs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprobs), torch.cat(entropies)


def selected_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    sampling: TokenSampling,
    select: torch.Tensor,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_logprobs` of the selected positions only ([N] bool `select`), scattered back to [N] (0 elsewhere).

    At least one position is always computed, so the result depends on the model even when nothing
    is selected (a filler micro-batch must still run the backward pass for FSDP's collectives).
    """
    computed = select.clone()
    if not bool(computed.any()) and computed.numel():
        computed[0] = True
    index = computed.nonzero().squeeze(-1)
    picked, entropy = head_logprobs(
        hidden[index], head, targets[index], sampling.take(index), chunk_tokens=chunk_tokens
    )
    logprobs = torch.zeros(select.shape, dtype=picked.dtype, device=hidden.device).index_put((index,), picked)
    entropies = torch.zeros(select.shape, dtype=entropy.dtype, device=hidden.device).index_put((index,), entropy)
    keep = select.to(logprobs.dtype)
    return logprobs * keep, entropies * keep


def output_head(model: Any) -> torch.nn.Module:
    """The output projection (lm_head) of a transformers causal LM, peft-wrapped or not."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"{type(model).__name__} has no output projection with a weight")
    return head


@contextmanager
def returning_hidden(model: Any) -> Iterator[torch.nn.Module]:
    """Inside: the model's forward returns its last hidden states [B, T, H] as `logits`; yields the head."""
    head = output_head(model)
    head.forward = lambda hidden: hidden
    try:
        yield head
    finally:
        del head.forward


@contextmanager
def computing_in_head(
    model: Any, targets: torch.Tensor, sampling: TokenSampling, select: torch.Tensor, chunk_tokens: int = CHUNK_TOKENS
) -> Iterator[None]:
    """Inside: the model's forward on one packed row [1, N] returns `logits` [1, N, 2]: each position's
    logprob of `targets` (0 where not `select`ed) and entropy, computed within the head's own call."""
    head = output_head(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])  # [N', H] (N' >= N: a padded pack)
        n = targets.shape[0]
        logprobs, entropy = selected_logprobs(flat[:n], head, targets, sampling, select, chunk_tokens=chunk_tokens)
        out = torch.stack([logprobs, entropy], dim=-1)  # [N, 2]
        if flat.shape[0] > n:
            out = torch.cat([out, out.new_zeros(flat.shape[0] - n, 2)])
        return out.unsqueeze(0).clone()  # not a view: FSDP2 hooks the output for its backward

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
