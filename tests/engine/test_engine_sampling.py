"""Sampling rules: greedy, temperature, top-k, top-p, per-choice seeds."""

from __future__ import annotations

import math
from collections import Counter

import torch

from services.engine.sampling import SamplingParams, choice_seed, raw_logprobs, sample_token, top_entries

PROBS = [0.4, 0.3, 0.2, 0.1]
LOGITS = torch.tensor([math.log(p) for p in PROBS])


def _draws(params: SamplingParams, count: int = 2000, seed: int = 7) -> Counter[int]:
    generator = torch.Generator().manual_seed(seed)
    return Counter(sample_token(LOGITS, params, generator) for _ in range(count))


def test_temperature_zero_is_argmax() -> None:
    assert _draws(SamplingParams(max_tokens=1, temperature=0.0), count=50) == Counter({0: 50})


def test_temperature_one_follows_the_model_distribution() -> None:
    counts = _draws(SamplingParams(max_tokens=1))
    for token, p in enumerate(PROBS):
        assert abs(counts[token] / 2000 - p) < 0.04, counts


def test_low_temperature_sharpens() -> None:
    counts = _draws(SamplingParams(max_tokens=1, temperature=0.25))
    assert counts[0] / 2000 > 0.6


def test_top_k_keeps_only_the_k_most_likely() -> None:
    assert set(_draws(SamplingParams(max_tokens=1, top_k=2))) == {0, 1}
    assert set(_draws(SamplingParams(max_tokens=1, top_k=1), count=100)) == {0}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # masses before each token: 0, 0.4, 0.7, 0.9 -> p=0.5 keeps tokens 0 and 1; p=0.75 keeps 0, 1, 2
    assert set(_draws(SamplingParams(max_tokens=1, top_p=0.5))) == {0, 1}
    assert set(_draws(SamplingParams(max_tokens=1, top_p=0.75))) == {0, 1, 2}
    assert set(_draws(SamplingParams(max_tokens=1, top_p=0.01), count=100)) == {0}


def test_same_generator_seed_same_draws() -> None:
    params = SamplingParams(max_tokens=1, temperature=1.3, top_p=0.9)
    assert _draws(params, 200, seed=3) == _draws(params, 200, seed=3)


def test_choice_seeds_are_stable_and_distinct() -> None:
    assert choice_seed(5, 0) == choice_seed(5, 0)
    seeds = {choice_seed(s, i) for s in range(20) for i in range(4)}
    assert len(seeds) == 80
    assert all(0 <= s < 2**63 for s in seeds)


def test_reported_logprobs_are_raw_and_top_entries_sorted() -> None:
    logprobs = raw_logprobs(LOGITS)
    assert torch.allclose(logprobs.exp(), torch.tensor(PROBS), atol=1e-6)
    top = top_entries(logprobs, 3)
    assert [t for t, _ in top] == [0, 1, 2]
    assert top[0][1] >= top[1][1] >= top[2][1]
    assert top_entries(logprobs, 0) == []
