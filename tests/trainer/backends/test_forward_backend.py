"""The CPU backend: a shared-prefix forward equals the plain one, and an update moves every parameter."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from trainer.backends.cpu import CpuBackend
from trainer.core import AdapterConfig, CallTokens, RolloutCalls, Sample, build_step
from trainer.forward import forward_logits, shared_prefix_length
from trainer.run.sections import AlgorithmSection, BackendSection, LossSection

VOCAB = 256
ONE_THREAD = BackendSection(threads=1)


def small_model(tmp_path: Path) -> Path:
    """A 2-layer Qwen2 with random weights saved to disk (the backend loads a model directory)."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def rows_with_shared_prefix(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows [4, T] that share a 24-token prefix and differ in length afterwards."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(24)]
    rows = [prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    length = max(map(len, rows))
    ids = torch.zeros((4, length), dtype=torch.long)
    mask = torch.zeros((4, length), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    return ids, mask


def test_shared_prefix_forward_equals_plain_forward_with_gradients(tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(small_model(tmp_path))
    ids, mask = rows_with_shared_prefix(1)
    assert shared_prefix_length(ids, mask) >= 24
    weights = torch.randn(ids.shape[0], ids.shape[1], VOCAB)

    def run(share: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logits = forward_logits(model, ids, mask, share_prefix=share)
        ((logits * weights * mask.unsqueeze(-1)).sum()).backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, plain_grads = run(False)
    shared, shared_grads = run(True)
    real = mask.bool()
    torch.testing.assert_close(shared[real], plain[real], rtol=1e-4, atol=1e-5)
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_no_shared_prefix_is_a_plain_forward() -> None:
    ids = torch.tensor([[5, 6, 7], [8, 6, 7]])
    mask = torch.ones_like(ids)
    assert shared_prefix_length(ids, mask) == 0
    assert shared_prefix_length(ids[:1], mask[:1]) == 0


def multi_turn_samples(seed: int, agent_of: Callable[[int], str] | None = None) -> list[Sample]:
    """Samples of 6 rollouts in 2 groups, each rollout two merged calls, with varied rewards.

    `agent_of(r)`, if given, names the agent that made rollout r's calls (recorded on each call).
    """
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(20)]
    rollouts = []
    for r in range(6):
        prompt = system + [rng.randrange(1, VOCAB) for _ in range(4)]
        calls = []
        for c in range(2):
            response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
            calls.append(
                CallTokens(
                    call_id=f"r{r}c{c}",
                    prompt_ids=prompt,
                    response_ids=response,
                    logprobs=[-rng.uniform(4.0, 7.0) for _ in response],
                    weights_version=0,
                    agent=agent_of(r) if agent_of else None,
                )
            )
            prompt = prompt + response + [rng.randrange(1, VOCAB) for _ in range(3)]
        rollouts.append(
            RolloutCalls(
                run_id="t",
                rollout_id=f"r{r}",
                group_id=f"g{r % 2}",
                attempt_id="a",
                reward=float(r % 3 == 0),
                calls=calls,
            )
        )
    return build_step(rollouts, AdapterConfig()).samples


def test_update_changes_every_parameter_and_weights_round_trip(tmp_path: Path) -> None:
    algorithm = AlgorithmSection(lr=1e-2, micro_batch_tokens=64, loss=LossSection(kl_coef=0.05))
    backend = CpuBackend(small_model(tmp_path), algorithm, seed=0, settings=ONE_THREAD)
    samples = multi_turn_samples(0)
    assert len(samples) == 6 and all(s.num_calls == 2 for s in samples)
    before = backend.parameters_snapshot()
    metrics = backend.update(samples)
    assert metrics.samples == 6 and metrics.micro_batches > 1 and metrics.optimizer_steps == 1
    assert metrics.tokens == sum(s.response_tokens for s in samples)
    assert metrics.entropy > 0 and metrics.kl_ref is not None and metrics.grad_norm > 0
    after = backend.parameters_snapshot()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters not updated: {unchanged}"

    saved = backend.save_weights(tmp_path / "v1")
    assert (saved / "model.safetensors").is_file() and (saved / "config.json").is_file()
    torch.save(backend.state(), tmp_path / "state.pt")  # as a checkpoint does
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    other = CpuBackend(small_model(tmp_path / "again"), algorithm, seed=0, settings=ONE_THREAD)
    other.load_weights(saved)
    other.load_state(state)
    for name, value in other.parameters_snapshot().items():
        assert torch.equal(value, after[name])
    # The same next update from the restored state gives the same weights (optimizer moments kept).
    backend.update(samples)
    other.update(samples)
    for name, value in other.parameters_snapshot().items():
        torch.testing.assert_close(value, backend.parameters_snapshot()[name])


def test_samples_without_advantage_leave_the_weights_alone(tmp_path: Path) -> None:
    backend = CpuBackend(small_model(tmp_path), AlgorithmSection(lr=1e-2), seed=0, settings=ONE_THREAD)
    samples = [s for s in multi_turn_samples(1) if s.group_id == "g1"]  # rewards 0, 0, 1 ... keep a flat group
    flat = [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "advantage": 0.0}) for s in samples]
    before = backend.parameters_snapshot()
    backend.update(flat)
    after = backend.parameters_snapshot()
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("updates", [2])
def test_several_updates_per_step_clip(tmp_path: Path, updates: int) -> None:
    algorithm = AlgorithmSection(lr=5e-2, updates_per_step=updates)
    backend = CpuBackend(small_model(tmp_path), algorithm, seed=0, settings=ONE_THREAD)
    metrics = backend.update(multi_turn_samples(2))
    assert metrics.optimizer_steps == updates
    assert metrics.clip_fraction > 0.0  # the second pass is off-policy and some ratios leave the clip range


def test_packed_micro_batches_equal_padded_ones(tmp_path: Path) -> None:
    """Samples back to back in one row (positions restarting per sample) give the padded rows' loss and gradient."""
    model = small_model(tmp_path)
    algorithm = AlgorithmSection(lr=1e-2, micro_batch_tokens=8192, loss=LossSection(kl_coef=0.05))
    samples = multi_turn_samples(0)
    packed = CpuBackend(model, algorithm, settings=BackendSection(threads=1, pack_sequences=True))
    padded = CpuBackend(model, algorithm, settings=BackendSection(threads=1, pack_sequences=False))
    assert packed.batch(samples).input_ids.shape == (1, sum(len(s.tokens) for s in samples))
    packed_loss, packed_grads = packed.loss_and_gradients(samples)
    padded_loss, padded_grads = padded.loss_and_gradients(samples)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    assert set(packed_grads) == set(padded_grads)
    for name, grad in padded_grads.items():
        assert float((packed_grads[name] - grad).norm()) <= 1e-5 * float(grad.norm()) + 1e-9, name
