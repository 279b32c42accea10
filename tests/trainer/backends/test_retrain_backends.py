"""Every backend re-trains off-policy through its ordinary `update`: `token_logprobs` and per-token advantages.

On a small random model with multi-turn samples whose behaviour logprobs are far from the
model's (as a re-trained model's are from the recorded run's): the CPU backend's `token_logprobs`
are the logprobs its `update` computes in its first forward pass; verl's (FSDP2 on CPU) equal them;
and one decoupled update gives the same loss, gradient norm and weights on both backends.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_forward_backend import multi_turn_samples, small_model

from trainer.backends.cpu import CpuBackend
from trainer.retrain import decoupled_samples, retrain_update
from trainer.run.sections import AlgorithmSection, BackendSection, LossSection

ALGORITHM = AlgorithmSection(lr=1e-2, micro_batch_tokens=64, loss=LossSection(clip_low=0.2, clip_high=0.2))
SETTINGS = BackendSection(threads=1)


def test_cpu_token_logprobs_are_the_first_forward_passes_and_the_decoupled_ratio_starts_at_one(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    samples = multi_turn_samples(0)
    cpu = CpuBackend(model, ALGORITHM, seed=0, settings=SETTINGS)
    proximal = cpu.token_logprobs(samples)
    trained = [s for s, p in zip(samples, proximal, strict=True) if p is not None]
    assert trained and len(trained) == sum(1 for s in samples if s.advantage != 0.0)
    for sample, row in zip(samples, proximal, strict=True):
        if row is not None:
            assert row.shape == (len(sample.tokens),) and row[0] == 0.0
            assert np.all(row[np.asarray(sample.loss_mask, dtype=bool)] < 0.0)

    decoupled, stats = decoupled_samples(samples, proximal, is_cap=2.0)
    assert stats.tokens > 0 and stats.kl_behaviour > 0.0  # the recorded logprobs are another policy's
    update = cpu.update(decoupled)
    assert update.ratio_mean == pytest.approx(1.0, abs=1e-6)  # π_θ = π_prox at the first forward pass
    assert update.approx_kl == pytest.approx(0.0, abs=1e-6) and update.clip_fraction == 0.0
    # the loss at the start is Σ tw·(-A·w) over the sampled tokens (r = 1)
    expected = sum(
        float(np.sum(-np.asarray(s.token_advantages)[np.asarray(s.loss_mask, dtype=bool)])) * s.token_weight
        for s in decoupled
        if s.token_advantages is not None
    )
    assert update.loss == pytest.approx(expected, rel=1e-5)


def test_verl_retrains_like_the_cpu_backend(tmp_path: Path) -> None:
    pytest.importorskip("verl")
    from trainer.backends.verl import VerlBackend

    model = small_model(tmp_path)
    samples = multi_turn_samples(1)
    cpu = CpuBackend(model, ALGORITHM, seed=0, settings=SETTINGS)
    verl = VerlBackend(model, ALGORITHM, seed=0, settings=SETTINGS)
    for ours, theirs in zip(cpu.token_logprobs(samples), verl.token_logprobs(samples), strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None and theirs is not None:
            np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)

    cpu_update, cpu_stats, _ = retrain_update(cpu, samples)
    verl_update, verl_stats, _ = retrain_update(verl, samples)
    assert cpu_update is not None and verl_update is not None
    assert verl_stats.kl_behaviour == pytest.approx(cpu_stats.kl_behaviour, rel=1e-5)
    assert verl_update.loss == pytest.approx(cpu_update.loss, rel=1e-5)
    assert verl_update.grad_norm == pytest.approx(cpu_update.grad_norm, rel=1e-5)
    assert math.isfinite(verl_update.entropy)
    got = verl.parameters_snapshot()
    for name, value in cpu.parameters_snapshot().items():
        if name in got:
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7)
    verl.close()
