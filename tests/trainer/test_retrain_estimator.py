"""Off-policy re-training's estimator and schemes, with numbers worked by hand.

Decoupled PPO (`trainer.retrain`): w = min(π_prox/π_behav, C), r = π_θ/π_prox, ℓ = w·PPO-clip(r).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.tools.retrain_schemes import parse_scheme
from trainer.core import AdapterConfig, AdapterConfigError, CallTokens, RolloutCalls, Sample, build_step
from trainer.loss import PolicyLossConfig, collate, policy_loss
from trainer.retrain import decoupled_samples
from trainer.run.sections import LossSection


def _sample(advantage: float = 1.0, token_weight: float = 0.5) -> Sample:
    """Tokens 5 7 9: 5 is prompt; 7 and 9 were sampled with behaviour probabilities 0.5 and 0.2."""
    return Sample(
        rollout_id="r", group_id="g", index=0, tokens=[5, 7, 9], loss_mask=[0, 1, 1],
        logprobs=[0.0, math.log(0.5), math.log(0.2)], call_ids=["c"], response_tokens=2,
        advantage=advantage, token_weight=token_weight,
    )  # fmt: skip


PROXIMAL = np.array([0.0, math.log(0.6), math.log(0.5)])
"""The re-trained model before the step gives tokens 7 and 9 probabilities 0.6 and 0.5."""


def test_importance_weight_is_proximal_over_behaviour_truncated_at_c() -> None:
    # w = 0.6/0.5 = 1.2 and 0.5/0.2 = 2.5, truncated to C = 2: per-token advantages A·w = 1.2, 2.0.
    (trained,), stats = decoupled_samples([_sample()], [PROXIMAL], is_cap=2.0)
    assert trained.token_advantages is not None
    assert np.allclose(trained.token_advantages, [0.0, 1.2, 2.0])
    assert np.allclose(trained.logprobs, PROXIMAL)  # the ratio PPO clips is now π_θ / π_prox
    assert trained.advantage == 1.0 and trained.token_weight == 0.5
    assert stats.tokens == 2 and stats.is_truncated_fraction == 0.5
    assert stats.is_weight_mean == pytest.approx(1.6)
    # KL(π_behav ‖ π_prox), k3: mean of r - 1 - ln r over r = 1.2, 2.5
    assert stats.kl_behaviour == pytest.approx(((0.2 - math.log(1.2)) + (1.5 - math.log(2.5))) / 2)


def test_untouched_when_the_backend_does_not_train_the_sample() -> None:
    sample = _sample(advantage=0.0)
    (kept,), stats = decoupled_samples([sample], [None])
    assert kept is sample and stats.tokens == 0


def test_loss_at_the_steps_start_is_w_times_advantage_and_the_stale_token_keeps_its_gradient() -> None:
    """At the step's start π_θ = π_prox, so r = 1 and ℓ = -A·w on each token: -0.5·(1.2 + 2.0) = -1.6.

    The naive ratio against the behaviour policy (the live loss) is 2.5 on token 9, clipped at
    1 + 0.28 with A > 0: that token gets no gradient at all (loss -0.5·(1.2 + 1.28) = -1.24).
    Decoupled PPO keeps its gradient, weighted by the truncated w = 2.
    """
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, ratio_cap=3.0)
    (trained,), _ = decoupled_samples([_sample()], [PROXIMAL], is_cap=2.0)
    current = torch.tensor([[math.log(0.6), math.log(0.5)]], requires_grad=True)  # [B, T-1]: π_θ = π_prox

    loss, metrics = policy_loss(current, collate([trained]), config)
    assert loss.item() == pytest.approx(-1.6, abs=1e-6)
    assert metrics.clip_fraction == 0.0
    loss.backward()
    assert current.grad is not None
    assert current.grad[0].tolist() == pytest.approx([-0.5 * 1.2, -0.5 * 2.0], abs=1e-6)  # dℓ/dlogπ = -tw·A·w·r

    naive = current.detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(naive, collate([_sample()]), config)
    assert loss.item() == pytest.approx(-0.5 * (1.2 + 1.28), abs=1e-6)
    loss.backward()
    assert naive.grad is not None
    assert naive.grad[0].tolist() == pytest.approx([-0.5 * 1.2, 0.0], abs=1e-6)


def _rollout(rid: str, reward: float, response: int) -> RolloutCalls:
    """One rollout of group g: one call, a 2-token prompt and `response` sampled tokens (logprob ln 0.5)."""
    call = CallTokens(call_id=f"{rid}-c", prompt_ids=[1, 2], response_ids=[3] * response,
                logprobs=[math.log(0.5)] * response)  # fmt: skip
    return RolloutCalls(run_id="run", rollout_id=rid, group_id="g", attempt_id="a", reward=reward, calls=[call])


def _start_loss(rollouts: list[RolloutCalls], spec: str) -> tuple[list[float], float, torch.Tensor]:
    """Advantages under the scheme, the step's loss at its start with π_prox = π_behav (w = 1, r = 1),
    and its gradient with respect to each token's logprob."""
    scheme = parse_scheme(spec, AdapterConfig(norm="rollout-mean", scale_std=False), LossSection())
    batch = build_step(rollouts, scheme.adapter)
    trained, _ = decoupled_samples(batch.samples, [np.asarray(s.logprobs) for s in batch.samples])
    current = collate(trained).old_logprobs.clone().requires_grad_(True)
    loss, _ = policy_loss(current, collate(trained), PolicyLossConfig())
    loss.backward()
    assert current.grad is not None
    return [s.advantage for s in batch.samples], loss.item(), current.grad


def test_rloo_scales_grpos_step_by_n_over_n_minus_1() -> None:
    """Rewards 1, 0, 0 (4 tokens each): GRPO's baseline is 1/3, so A = 2/3, -1/3, -1/3; RLOO's
    leave-one-out baselines are 0, 1/2, 1/2, so A = 1, -1/2, -1/2: the same direction, 3/2 as
    large. rollout-mean gives each rollout 1/3 of the loss, 1/4 per token: GRPO's loss at the
    start is -(2/3 - 1/3 - 1/3)/3 = 0, and so is RLOO's, but each token's gradient is 3/2 times."""
    rollouts = [_rollout("a", 1.0, 4), _rollout("b", 0.0, 4), _rollout("c", 0.0, 4)]
    grpo, grpo_loss, grpo_grad = _start_loss(rollouts, "grpo")
    rloo, rloo_loss, rloo_grad = _start_loss(rollouts, "RLOO")
    assert grpo == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert rloo == pytest.approx([1.0, -0.5, -0.5])
    assert grpo_loss == pytest.approx(0.0, abs=1e-6) and rloo_loss == pytest.approx(0.0, abs=1e-6)
    # each sampled token of the winner: -(1/3)(1/4)·A = -1/18 under GRPO, -1/12 under RLOO
    assert grpo_grad[0, 1:].tolist() == pytest.approx([-1 / 18] * 4, abs=1e-6)
    assert torch.allclose(rloo_grad, 1.5 * grpo_grad, atol=1e-7)


def test_token_mean_weighs_the_long_rollout_more_than_rollout_mean() -> None:
    """Rewards 1 and 0 (A = +1/2, -1/2): a 2-token winner and an 8-token loser.

    rollout-mean: each rollout half the loss: -(1/2)·(1/2) + (1/2)·(1/2) = 0.
    token-mean: every token 1/10: -(1/2)·2/10 + (1/2)·8/10 = +0.3: the loss now mostly pushes
    the long losing rollout down, the direction token-mean implies.
    """
    rollouts = [_rollout("short", 1.0, 2), _rollout("long", 0.0, 8)]
    _, rollout_mean, _ = _start_loss(rollouts, "rollout-mean")
    _, token_mean, _ = _start_loss(rollouts, "norm=token-mean")
    assert rollout_mean == pytest.approx(0.0, abs=1e-6)
    assert token_mean == pytest.approx(0.3, abs=1e-6)


def test_a_scheme_sets_the_loss_switches_and_refuses_unknown_ones() -> None:
    scheme = parse_scheme("GRPO+clip=0.1+kl=0.01+ratio-cap=none+is-cap=3", AdapterConfig(estimator="rloo"),
                          LossSection())  # fmt: skip
    assert scheme.adapter.estimator == "grpo"
    assert (scheme.loss.clip_low, scheme.loss.clip_high, scheme.loss.kl_coef) == (0.1, 0.1, 0.01)
    assert scheme.loss.ratio_cap is None and scheme.is_cap == 3.0
    with pytest.raises(AdapterConfigError, match="unknown scheme"):
        parse_scheme("ppo", AdapterConfig(), LossSection())
    with pytest.raises(AdapterConfigError, match="clip_low"):
        parse_scheme("clip=1.5", AdapterConfig(), LossSection())
