"""verl's FSDP2 engine (on CPU: gloo, sdpa, verl's platform registry) trains exactly like the CPU backend.

Same model, same samples (multi-turn, observations masked), each loss normalization, KL on: the
same loss, gradients equal to 1e-5 relative, the same weights after one optimizer step; the same
for LoRA (adapters trained, the adapter exported). verl is optional (`rollwire[verl]`).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("peft")

from test_forward_backend import VOCAB, multi_turn_samples, small_model

from trainer.backends import lora
from trainer.backends.cpu import CpuBackend
from trainer.core import AdapterConfig, CallTokens, RolloutCalls, Sample, build_step
from trainer.core.weights import Norm
from trainer.run.sections import AlgorithmSection, BackendSection, LossSection

NORMS: list[Norm] = ["rollout-mean", "token-mean", "seq-mean-token-mean"]


def renormalized(samples: list[Sample], norm: Norm) -> list[Sample]:
    """The same samples with loss weights of another normalization (weights are fixed per step)."""
    import msgspec

    from trainer.core.weights import loss_weights

    return [
        msgspec.structs.replace(s, token_weight=w) for s, w in zip(samples, loss_weights(samples, norm), strict=True)
    ]


@pytest.fixture(scope="module")
def verl_backend_factory():  # type: ignore[no-untyped-def]
    from trainer.backends.verl import VerlBackend

    return VerlBackend


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_verl_matches_the_cpu_backend(tmp_path: Path, norm: Norm, lora_rank: int, verl_backend_factory) -> None:  # type: ignore[no-untyped-def]
    model = small_model(tmp_path)
    algorithm = AlgorithmSection(lr=1e-2, micro_batch_tokens=64, loss=LossSection(kl_coef=0.05))
    settings = BackendSection(threads=1, lora_rank=lora_rank, lora_alpha=8)
    samples = renormalized(multi_turn_samples(0), norm)
    cpu = CpuBackend(model, algorithm, seed=0, settings=settings)
    verl = verl_backend_factory(model, algorithm, seed=0, settings=settings)

    cpu_loss, cpu_grads = cpu.loss_and_gradients(samples)
    verl_loss, verl_grads = verl.loss_and_gradients(samples)
    assert verl_loss == pytest.approx(cpu_loss, rel=1e-5)
    assert set(cpu_grads) <= set(verl_grads) | {"lm_head.weight"}
    for name, grad in cpu_grads.items():
        if name in verl_grads:
            assert _relative(verl_grads[name], grad) < 1e-5, name

    cpu_metrics, verl_metrics = cpu.update(samples), verl.update(samples)
    assert verl_metrics.loss == pytest.approx(cpu_metrics.loss, rel=1e-5)
    assert verl_metrics.tokens == cpu_metrics.tokens and verl_metrics.optimizer_steps == 1
    assert verl_metrics.kl_ref == pytest.approx(cpu_metrics.kl_ref, rel=1e-4, abs=1e-9)
    assert verl_metrics.entropy == pytest.approx(cpu_metrics.entropy, rel=1e-5)
    assert verl_metrics.grad_norm == pytest.approx(cpu_metrics.grad_norm, rel=1e-5)
    cpu_saved = cpu.save_weights(tmp_path / "cpu")
    verl_saved = verl.save_weights(tmp_path / "verl")
    from safetensors.torch import load_file

    # LoRA: the adapter (what vLLM serves) and the merged model (plain weights, the adapter merged in)
    names = ["model.safetensors"] + (["adapters/default/adapter_model.safetensors"] if lora_rank else [])
    for name in names:
        expected, got = load_file(str(cpu_saved / name)), load_file(str(verl_saved / name))
        assert set(got) <= set(expected) and got, name
        for key, value in got.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-7)
    verl.close()


def varied_length_samples(seed: int, rollouts: int = 32) -> list[Sample]:
    """One call per rollout, prompts of 10..200 tokens and responses of 2..40: a quickstart-like step."""
    rng = random.Random(seed)
    made = []
    for r in range(rollouts):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(10, 200))]
        response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 40))]
        logprobs = [-rng.uniform(4.0, 7.0) for _ in response]
        call = CallTokens(
            call_id=f"r{r}c0", prompt_ids=prompt, response_ids=response, logprobs=logprobs, weights_version=0
        )
        made.append(RolloutCalls(run_id="t", rollout_id=f"r{r}", group_id=f"g{r % 4}", attempt_id="a",
                                 reward=float(r % 3 == 0), calls=[call]))  # fmt: skip
    return build_step(made, AdapterConfig()).samples


def test_verl_matches_the_cpu_backend_on_packed_micro_batches(tmp_path: Path, verl_backend_factory) -> None:  # type: ignore[no-untyped-def]
    """32 samples of very different lengths in one micro-batch: verl's jagged outputs are padded per sample."""
    model = small_model(tmp_path)
    algorithm = AlgorithmSection(lr=1e-2, micro_batch_tokens=8192, loss=LossSection(kl_coef=0.05))
    settings = BackendSection(threads=1)
    samples = renormalized(varied_length_samples(1), "token-mean")
    assert len({len(s.tokens) for s in samples}) > 16 and sum(len(s.tokens) for s in samples) <= 8192
    cpu = CpuBackend(model, algorithm, seed=0, settings=settings)
    verl = verl_backend_factory(model, algorithm, seed=0, settings=settings)

    cpu_loss, cpu_grads = cpu.loss_and_gradients(samples)
    verl_loss, verl_grads = verl.loss_and_gradients(samples)
    assert verl_loss == pytest.approx(cpu_loss, rel=1e-5)
    for name, grad in cpu_grads.items():
        if name in verl_grads:
            assert _relative(verl_grads[name], grad) < 1e-5, name
    before = cpu.parameters_snapshot()
    cpu_metrics, verl_metrics = cpu.update(samples), verl.update(samples)
    assert verl_metrics.micro_batches == 1
    assert verl_metrics.loss == pytest.approx(cpu_metrics.loss, rel=1e-5)
    assert verl_metrics.tokens == cpu_metrics.tokens
    assert verl_metrics.entropy == pytest.approx(cpu_metrics.entropy, rel=1e-5)
    assert verl_metrics.grad_norm == pytest.approx(cpu_metrics.grad_norm, rel=1e-5)
    cpu_weights, verl_weights = cpu.parameters_snapshot(), verl.parameters_snapshot()
    assert set(verl_weights) <= set(cpu_weights) and verl_weights
    # Adam's g/(|g|+eps) magnifies float rounding on gradients ~1e-8 (4 orders below a tensor's largest),
    # so the step is compared as a whole: the same update to 1e-4 relative.
    for name, value in verl_weights.items():
        assert _relative(value - before[name], cpu_weights[name] - before[name]) < 1e-4, name
    verl.close()


def agent_of(rollout: int) -> str:
    """Two agent roles: rollouts r0..r2 are the planner's calls, the rest the coder's."""
    return "planner" if rollout < 3 else "coder"


@pytest.mark.parametrize("backend", ["cpu", "verl"])
def test_one_adapter_per_role(tmp_path: Path, backend: str, verl_backend_factory) -> None:  # type: ignore[no-untyped-def]
    """Each role's calls train its own adapter on one base model; the other adapter gets none of its gradient.

    The role is the agent recorded on the calls, carried by the adapter onto the samples (no role mapping
    is injected): each adapter trains on exactly its role's samples.
    """
    model = small_model(tmp_path)
    algorithm = AlgorithmSection(lr=1e-2, micro_batch_tokens=64)
    settings = BackendSection(threads=1, lora_rank=4, lora_alpha=8,
                              lora_adapters={"planner": "planner", "coder": "coder"})  # fmt: skip
    make = CpuBackend if backend == "cpu" else verl_backend_factory
    samples = multi_turn_samples(0, agent_of)
    split = lora.split_by_adapter(samples, settings)
    print(f"{backend}: samples per adapter { ({k: len(v) for k, v in split.items()}) } of {len(samples)}")
    assert {k: len(v) for k, v in split.items()} == {"planner": 3, "coder": 3}
    assert all(s.agent == name for name, group in split.items() for s in group)
    both = make(model, algorithm, seed=0, settings=settings)
    _, grads = both.loss_and_gradients(samples)
    planner_only = make(model, algorithm, seed=0, settings=settings)
    _, planner_grads = planner_only.loss_and_gradients(split["planner"])
    planner = {k: v for k, v in grads.items() if ".planner." in k}
    coder = {k: v for k, v in grads.items() if ".coder." in k}
    # lora_B starts at 0, so lora_A's first gradient is 0: check B's
    assert planner and coder and all(float(v.abs().sum()) > 0 for k, v in grads.items() if "lora_B" in k)
    for key, value in planner.items():  # the coder's calls add nothing to the planner's adapter
        torch.testing.assert_close(value, planner_grads[key], rtol=1e-5, atol=1e-8)
    assert not any(".coder." in k and float(v.abs().sum()) > 0 for k, v in planner_grads.items())
    metrics = both.update(samples)
    assert metrics.samples == len(samples) and metrics.optimizer_steps == 1
    saved = both.save_weights(tmp_path / "v1")
    assert {p.name for p in (saved / "adapters").iterdir()} == {"coder", "planner"}
    assert not (saved / "model.safetensors").exists()  # several adapters are served by vLLM, never merged
    if backend == "verl":
        both.close()
