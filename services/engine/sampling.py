"""Choosing the next token from a row of logits, and the logprobs reported for it.

Logprob definition (vLLM's `processed_logprobs` mode, `--logprobs-mode processed_logprobs`): the
reported logprob of a token, and every `top_logprobs` entry, is the log-probability under the
distribution the token was actually drawn from: the logits divided by the temperature, then top-k
and top-p truncation (tokens outside get -inf), then `log_softmax`. That is the behaviour
probability an importance ratio needs; the raw model logprob (temperature 1, no truncation) is
that only when sampling was plain. Greedy requests (temperature 0) report the truncated
distribution at temperature 1, as vLLM does.

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


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] as sampled from: over the temperature (1 when greedy), then top-k / top-p truncated."""
    temperature = params.temperature if params.temperature > 0.0 else 1.0
    return _truncate(logits.float() / temperature, params.top_k, params.top_p)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id drawn from logits [V] (float32) under `params`."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(processed_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Raw model logprobs [V] (temperature 1, no truncation)."""
    return torch.log_softmax(logits.float(), dim=-1)


def sampled_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logprobs [V] of the distribution a token is drawn from (-inf outside top-k / top-p): what is reported."""
    return torch.log_softmax(processed_logits(logits, params), dim=-1)


def top_entries(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs, most likely first.

    A token outside top-k / top-p has logprob -inf, reported as -9999.0 as vLLM's API does (JSON
    has no infinity).
    """
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, k)
    return [(i, v if v != float("-inf") else -9999.0) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
