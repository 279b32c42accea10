"""A reference of vLLM's sampler, for tests that sample on policy without a server: the distribution a
token is drawn from, and the logprobs vLLM reports for it with `--logprobs-mode processed_logprobs`.

It follows vLLM's `vllm/v1/sample/sampler.py` (`Sampler.forward`: the logits divided by the
temperature, then top-k and top-p, then the processed logprobs are the `log_softmax` of what is
sampled from) and `vllm/v1/sample/ops/topk_topp_sampler.py` (`apply_top_k_top_p_pytorch`: logits
below the k-th largest are masked; sorted ascending, the smallest tail whose probability mass is at
most 1 - p is masked, the most likely token always kept). Sampling here draws with
`torch.multinomial` from a seeded generator (vLLM draws with exponential races: the same
distribution, other draws). Temperature must be positive (greedy calls report nothing to correct).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """A call's sampling settings, as its recorded call carries them (top_k 0: no top-k)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] as vLLM samples from them: over the temperature, everything outside top-k / top-p at -inf."""
    assert params.temperature > 0.0, "a greedy call is not sampled"
    row = logits.float() / params.temperature
    if 0 < params.top_k < row.shape[-1]:
        row = row.masked_fill(row < torch.topk(row, params.top_k).values[-1], float("-inf"))
    if params.top_p < 1.0:
        ordered, index = row.sort(descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - params.top_p
        drop[-1] = False
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, index, drop), float("-inf"))
    return row


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logprobs [V] of the distribution a token is drawn from (-inf outside top-k / top-p): what vLLM reports."""
    return torch.log_softmax(processed_logits(logits, params), dim=-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id drawn from logits [V] under `params`."""
    probs = torch.softmax(processed_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
