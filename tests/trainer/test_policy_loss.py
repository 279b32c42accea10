"""The policy loss on a tiny randomly initialised causal LM: micro-batching never changes the gradient."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
import transformers
from reference_sampler import SamplingParams, processed_logprobs

from trainer.core import AdapterConfig, CallTokens, RolloutCalls, Sample, build_step, plain
from trainer.loss import PolicyBatch, PolicyLossConfig, collate, policy_loss, token_entropy, token_logprobs

VOCAB = 300


def tiny_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config).float()


def eight_samples() -> list[Sample]:
    """Eight samples of varied length from four rollouts in two groups (multi-turn, so merged)."""
    rng = random.Random(1)
    rollouts = []
    for r in range(4):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 8))]
        calls = []
        for c in range(4):
            if c == 2:  # a new chain: rollout r yields two samples
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 8))]
            response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))]
            logprobs = [-rng.uniform(0.5, 9.0) for _ in response]  # ratios far from 1: clips active
            calls.append(CallTokens(call_id=f"r{r}c{c}", prompt_ids=prompt, response_ids=response, logprobs=logprobs))
            prompt = prompt + response + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 4))]
        rollouts.append(
            RolloutCalls(
                run_id="t", rollout_id=f"r{r}", group_id=f"g{r // 2}", attempt_id="a", reward=float(r), calls=calls
            )
        )
    samples = build_step(rollouts, AdapterConfig()).samples
    assert len(samples) == 8
    return samples


def loss_and_grads(
    model: transformers.PreTrainedModel, samples: list[Sample], config: PolicyLossConfig
) -> tuple[float, list]:
    batch = collate(samples)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V]
    ref = token_logprobs(logits, batch.input_ids).detach() - 0.3  # a reference that differs
    loss, metrics = policy_loss(token_logprobs(logits, batch.input_ids), batch, config, ref_logprobs=ref, logits=logits)
    assert metrics.entropy is not None and 0.0 < metrics.entropy <= math.log(VOCAB) + 1e-4
    loss.backward()
    return loss.item(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_one_step_of_eight_equals_eight_micro_batches_of_one() -> None:
    samples = eight_samples()
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, ratio_cap=3.0, kl_coef=0.1)
    model = tiny_model()
    full_loss, full = loss_and_grads(model, samples, config)
    micro_loss, summed = 0.0, [torch.zeros_like(g) for g in full]
    for s in samples:
        model.zero_grad()
        loss, grads = loss_and_grads(model, [s], config)
        micro_loss += loss
        summed = [a + b for a, b in zip(summed, grads, strict=True)]
    assert micro_loss == pytest.approx(full_loss, rel=1e-5)
    for g_full, g_micro in zip(full, summed, strict=True):
        torch.testing.assert_close(g_micro, g_full, rtol=1e-4, atol=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in full)


def test_one_update_changes_every_parameter() -> None:
    samples = eight_samples()
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_and_grads(model, samples, PolicyLossConfig())
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_token_logprobs_shift_by_one() -> None:
    logits = torch.randn(2, 5, 7)  # [B, T, V]
    ids = torch.randint(0, 7, (2, 5))  # [B, T]
    got = token_logprobs(logits, ids)  # [B, T-1]
    assert got.shape == (2, 4)
    for b in range(2):
        for t in range(4):
            expected = torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]]
            assert float(got[b, t]) == pytest.approx(float(expected), abs=1e-6)
    uniform = token_entropy(torch.zeros(1, 3, 7))
    assert torch.allclose(uniform, torch.full((1, 2), torch.log(torch.tensor(7.0)).item()))


def _one_token_batch(advantage: float, old_logprob: float) -> PolicyBatch:
    sample = Sample(
        rollout_id="r",
        group_id="g",
        index=0,
        tokens=[1, 2],
        loss_mask=[0, 1],
        logprobs=[0.0, old_logprob],
        call_ids=["c"],
        response_tokens=1,
        advantage=advantage,
        token_weight=0.5,
    )
    return collate([sample])


@pytest.mark.parametrize(
    ("advantage", "log_ratio", "expected", "clipped", "dual"),
    [
        (1.0, 0.0, -0.5, 0.0, 0.0),  # on-policy: ℓ = -A·1, weighted by 0.5
        (1.0, 1.0, -0.5 * 1.2, 1.0, 0.0),  # ratio e > 1+ε: clipped at 1.2
        (-1.0, -1.0, 0.5 * 0.8, 1.0, 0.0),  # ratio 1/e < 1-ε with A < 0: clipped at 0.8
        (-1.0, 2.0, 0.5 * 3.0, 0.0, 1.0),  # ratio e² > c = 3 with A < 0: dual clip caps at c
        (-1.0, 0.5, 0.5 * float(torch.tensor(0.5).exp()), 0.0, 0.0),  # between: unclipped
    ],
)
def test_clipping_cases(advantage: float, log_ratio: float, expected: float, clipped: float, dual: float) -> None:
    batch = _one_token_batch(advantage, old_logprob=-2.0)
    logprobs = torch.tensor([[-2.0 + log_ratio]], requires_grad=True)  # [B=1, T-1=1]
    loss, metrics = policy_loss(logprobs, batch, PolicyLossConfig(clip_low=0.2, clip_high=0.2, ratio_cap=3.0))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert (metrics.clip_fraction, metrics.dual_clip_fraction, metrics.tokens) == (clipped, dual, 1)
    loss.backward()
    assert logprobs.grad is not None
    assert bool(torch.all(logprobs.grad == 0)) == bool(clipped or dual)  # clipped tokens get no gradient


def test_kl_to_reference_and_errors() -> None:
    batch = _one_token_batch(0.0, old_logprob=-1.0)
    logprobs = torch.tensor([[-1.0]])
    loss, metrics = policy_loss(logprobs, batch, PolicyLossConfig(kl_coef=0.5), ref_logprobs=torch.tensor([[-2.0]]))
    k3 = float(torch.tensor(-1.0).exp()) + 1.0 - 1.0  # exp(ref - logp) - (ref - logp) - 1 at ref - logp = -1
    assert float(loss) == pytest.approx(0.5 * 0.5 * k3) and metrics.kl_ref == pytest.approx(k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, batch, PolicyLossConfig(kl_coef=0.5))
    with pytest.raises(ValueError, match="ratio_cap"):
        PolicyLossConfig(ratio_cap=0.5)


def test_collate_aligns_targets_and_pads() -> None:
    samples = eight_samples()[:2]
    batch = collate(samples, pad_id=0)
    longest = max(len(s.tokens) for s in samples)
    assert batch.input_ids.shape == (2, longest) and batch.loss_mask.shape == (2, longest - 1)
    for row, s in enumerate(samples):
        n = len(s.tokens)
        assert batch.input_ids[row, :n].tolist() == plain(s.tokens) and batch.attention_mask[row].sum() == n
        assert batch.loss_mask[row, : n - 1].tolist() == plain(s.loss_mask[1:])
        assert batch.old_logprobs[row, : n - 1].tolist() == pytest.approx(plain(s.logprobs[1:]))
        assert batch.loss_mask[row, n - 1 :].sum() == 0 and batch.token_weight[row, n - 1 :].sum() == 0


def test_the_loss_recomputes_logprobs_at_each_samples_own_temperature() -> None:
    """Behaviour logprobs recorded at T=0.7 and T=1.3 (as vLLM reports them) give ratio 1 on policy."""
    model = tiny_model().eval()
    samples = []
    for temperature, seed in ((0.7, 1), (1.3, 2), (None, 3)):
        gen = torch.Generator().manual_seed(seed)
        prompt = [5, 17, 33, 2]
        tokens, logprobs = list(prompt), [0.0] * len(prompt)
        params = SamplingParams(temperature=temperature or 1.0)
        with torch.no_grad():
            for _ in range(6):
                row = model(input_ids=torch.tensor([tokens])).logits[0, -1].float()
                scores = processed_logprobs(row, params)
                token = int(torch.multinomial(scores.exp(), 1, generator=gen))
                tokens.append(token)
                logprobs.append(float(scores[token]))
        samples.append(
            Sample(
                rollout_id=f"r{seed}",
                group_id="g",
                index=0,
                tokens=tokens,
                loss_mask=[0] * 4 + [1] * 6,
                logprobs=logprobs,
                call_ids=["c"],
                response_tokens=6,
                temperature=temperature,
                advantage=1.0,
                token_weight=1.0,
            )
        )
    batch = collate(samples, default_temperature=1.0)
    assert batch.temperature is not None
    assert batch.temperature.view(-1).tolist() == pytest.approx([0.7, 1.3, 1.0])
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    new = token_logprobs(logits, batch.input_ids, temperature=batch.temperature)
    mask = batch.loss_mask.bool()
    assert torch.allclose(new[mask], batch.old_logprobs[mask], atol=1e-5)
    at_one = token_logprobs(logits, batch.input_ids)  # one temperature for all: the ratio is off
    assert not torch.allclose(at_one[mask], batch.old_logprobs[mask], atol=1e-2)
    _, metrics = policy_loss(new, batch, PolicyLossConfig())
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-5) and metrics.clip_fraction == 0.0


def test_a_call_at_another_temperature_starts_its_own_sample() -> None:
    calls = [
        CallTokens(call_id="a", prompt_ids=[1, 2], response_ids=[3], logprobs=[-1.0], temperature=0.7),
        CallTokens(call_id="b", prompt_ids=[1, 2, 3, 4], response_ids=[5], logprobs=[-1.0], temperature=1.0),
        CallTokens(call_id="c", prompt_ids=[1, 2, 3, 4, 5, 6], response_ids=[7], logprobs=[-1.0], temperature=1.0),
    ]
    rollout = RolloutCalls(run_id="r", rollout_id="ro", group_id=None, attempt_id=None, reward=1.0, calls=calls)
    batch = build_step([rollout], AdapterConfig())
    assert [(s.call_ids, s.temperature) for s in batch.samples] == [(["a"], 0.7), (["b", "c"], 1.0)]
