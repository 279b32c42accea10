"""Choosing the next token from a row of logits, and the logprobs reported for it.

Logprob definition (vLLM's default `raw_logprobs` mode): the reported logprob of a token, and every
`top_logprobs` entry, is the model's raw `log_softmax(logits)` at temperature 1, before temperature
scaling, top-k and top-p. It is the probability the current weights give the token, which is what a
trainer recomputes with a forward pass and what importance ratios compare against. It equals the
log-probability under the distribution the token was drawn from only when temperature is 1 and no
top-k/top-p truncation is active; with other settings the sampling distribution is the processed one
below and the reported number is still the raw model logprob.

Sampling: temperature 0 is greedy (argmax, lowest id on ties). Otherwise logits are divided by the
temperature, top-k keeps the k largest, top-p keeps the smallest prefix of tokens (by decreasing
probability) whose mass reaches p (always at least one), and one token is drawn with
`torch.multinomial` from the choice's own seeded `torch.Generator`.
"""

from __future__ import annotations

import hashlib

import msgspec
import torch


class SamplingParams(msgspec.Struct, frozen=True):
    """How to sample one request's choices (already validated)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


def choice_seed(request_seed: int, choice: int) -> int:
    """The torch seed of choice `choice` of a request seeded with `request_seed` (independent streams)."""
    digest = hashlib.sha256(f"rollwire-engine/{request_seed}/{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with everything outside top-k / top-p set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id drawn from logits [V] (float32) under `params`."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    processed = _truncate(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(processed, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Raw model logprobs [V] (temperature 1, no truncation): the numbers reported to clients."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_entries(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs, most likely first."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, k)
    return list(zip(ids.tolist(), values.tolist(), strict=True))
