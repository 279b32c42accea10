"""The log-prob path of every backend: chunked (no per-token loop, no whole-sequence logits), and on
policy at every sampling setting (each sample's own temperature, top_p and top_k: ratio 1, nothing clipped).

On-policy samples are drawn here from the model's own processed distribution with a reference of
vLLM's sampler (`tests/reference_sampler.py`), recorded as calls and built into samples by the adapter,
so they carry the call records' temperature, top_p and top_k the way the trainer's do.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from reference_sampler import SamplingParams, processed_logprobs, sample_token
from test_forward_backend import small_model

from trainer.backends.cpu import CpuBackend
from trainer.core import AdapterConfig, CallTokens, RolloutCalls, Sample, build_step
from trainer.run.sections import AlgorithmSection, BackendSection, LossSection

REAL_VOCAB = 151_936  # Qwen2's


def _verl() -> Any:
    pytest.importorskip("verl")
    from trainer.backends.verl import VerlBackend

    return VerlBackend


BACKENDS: dict[str, Callable[[], Any]] = {"cpu": lambda: CpuBackend, "verl": _verl}


def on_policy_samples(model_dir: Path, params: SamplingParams, *, agent: str | None = None, rollouts: int = 4,
                      seed: int = 0) -> list[Sample]:  # fmt: skip
    """Rollouts of one call each, sampled from the model at `params` (logprobs as vLLM reports them)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    made = []
    for r in range(rollouts):
        prompt = [rng.randrange(1, vocab) for _ in range(8)]
        ids, logprobs = list(prompt), []
        generator = torch.Generator().manual_seed(seed * 100 + r)
        with torch.no_grad():
            for _ in range(12):
                row = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                token = sample_token(row, params, generator)
                logprobs.append(float(processed_logprobs(row, params)[token]))
                ids.append(token)
        call = CallTokens(call_id=f"r{r}", prompt_ids=prompt, response_ids=ids[len(prompt):], logprobs=logprobs,
                    weights_version=0, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                    agent=agent)  # fmt: skip
        made.append(RolloutCalls(run_id="t", rollout_id=f"r{r}", group_id="g0", attempt_id="a", calls=[call],
                                 reward=float(r % 2)))  # fmt: skip
    return build_step(made, AdapterConfig()).samples


SETTINGS = {
    "T=0.5": SamplingParams(temperature=0.5),
    "T=1.0": SamplingParams(temperature=1.0),
    "T=0.7 top_p=0.8 top_k=20": SamplingParams(temperature=0.7, top_p=0.8, top_k=20),
    "T=1.0 top_p=0.7": SamplingParams(temperature=1.0, top_p=0.7),
}


@pytest.mark.parametrize("backend", ["cpu", "verl"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_on_policy_ratio_is_one_at_every_sampling_setting(tmp_path: Path, backend: str, setting: str) -> None:
    """The loss temperature default is planted wrong (2.0): each sample's recorded settings must win."""
    make = BACKENDS[backend]()
    model = small_model(tmp_path)
    samples = on_policy_samples(model, SETTINGS[setting])
    params = SETTINGS[setting]
    assert {(s.temperature, s.top_p, s.top_k) for s in samples} == {
        (params.temperature, params.top_p if params.top_p < 1 else None, params.top_k or None)
    }  # the adapter carried the call records' settings onto the samples
    algorithm = AlgorithmSection(lr=1e-3, micro_batch_tokens=4096, loss_temperature=2.0, loss=LossSection())
    trainer = make(model, algorithm, seed=0, settings=BackendSection(threads=1))
    metrics = trainer.update(samples)
    print(f"{backend} {setting}: ratio {metrics.ratio_mean:.6f}, clipped {metrics.clip_fraction:.4f}")
    assert metrics.tokens == 4 * 12
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-4)
    assert metrics.clip_fraction == 0.0 and metrics.approx_kl < 1e-8
    if backend == "verl":
        trainer.close()


def real_vocab_model(tmp_path: Path) -> Path:
    """A 1-layer Qwen2 with Qwen2's vocabulary of 151,936 (hidden size 16: the head is the big part)."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=REAL_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "big-vocab")
    return tmp_path / "big-vocab"


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Counter[str], list[int]]]:
    """Counts log-softmax / logsumexp calls, and records the rows of every [.., V] projection output."""
    calls: Counter[str] = Counter()
    rows: list[int] = []
    F = torch.nn.functional
    originals = {"torch.log_softmax": torch.log_softmax, "F.log_softmax": F.log_softmax,
                 "Tensor.log_softmax": torch.Tensor.log_softmax, "torch.logsumexp": torch.logsumexp,
                 "Tensor.logsumexp": torch.Tensor.logsumexp}  # fmt: skip
    linear = F.linear

    def wrap(name: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return counted

    def measured(x: torch.Tensor, weight: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
        out = linear(x, weight, *rest, **kwargs)
        if out.shape[-1] == REAL_VOCAB:
            rows.append(out.numel() // REAL_VOCAB)
        return out

    for name, targets in (("torch.log_softmax", (torch, "log_softmax")), ("F.log_softmax", (F, "log_softmax")),
                          ("Tensor.log_softmax", (torch.Tensor, "log_softmax")),
                          ("torch.logsumexp", (torch, "logsumexp")),
                          ("Tensor.logsumexp", (torch.Tensor, "logsumexp"))):  # fmt: skip
        monkeypatch.setattr(targets[0], targets[1], wrap(name))
    monkeypatch.setattr(F, "linear", measured)
    yield calls, rows


def long_samples(vocab: int) -> list[Sample]:
    """Two rollouts of 1,200 tokens each (200 prompt, 1,000 sampled), one micro-batch."""
    rng = random.Random(3)
    made = []
    for r in range(2):
        prompt = [rng.randrange(1, vocab) for _ in range(200)]
        response = [rng.randrange(1, vocab) for _ in range(1000)]
        call = CallTokens(call_id=f"r{r}", prompt_ids=prompt, response_ids=response, logprobs=[-11.9] * len(response),
                    weights_version=0)  # fmt: skip
        made.append(RolloutCalls(run_id="t", rollout_id=f"r{r}", group_id="g", attempt_id="a", calls=[call],
                                 reward=float(r)))  # fmt: skip
    return build_step(made, AdapterConfig()).samples


@pytest.mark.parametrize("backend", ["cpu", "verl"])
def test_the_log_prob_path_is_chunked_at_a_real_vocabulary(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,400 tokens (2,000 sampled) at vocabulary 151,936: a few log-softmax calls per 1,024-token chunk
    (forward and the backward's recomputation), never one per token; no projection over more than a chunk."""
    make = BACKENDS[backend]()
    model = real_vocab_model(tmp_path)
    samples = long_samples(REAL_VOCAB)
    algorithm = AlgorithmSection(lr=1e-3, micro_batch_tokens=4096)
    trainer = make(model, algorithm, seed=0, settings=BackendSection(threads=1, logprob_chunk_tokens=1024))
    with counting(monkeypatch) as (calls, rows):
        loss, _ = trainer.loss_and_gradients(samples)
    total = sum(calls.values())
    print(f"{backend}: per-token Python calls on the log-prob path for 2,400 tokens: {dict(calls)} = {total}; "
          f"largest projection {max(rows, default=0)} rows")  # fmt: skip
    assert loss == loss  # not NaN
    assert total <= 12, calls  # 2 chunks x (forward + recomputation) x (log_softmax); a per-token loop is 2,000+
    assert rows and max(rows) <= 1024, rows  # never the logits of the whole micro-batch at once
    if backend == "verl":
        trainer.close()


def test_an_adapter_without_samples_is_loud(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Roles the samples do not carry: an error when no adapter gets a sample, a warning naming the empty one."""
    from trainer.backends import lora

    samples = on_policy_samples(small_model(tmp_path), SETTINGS["T=1.0"], agent="planner", rollouts=2)
    wrong = BackendSection(lora_rank=4, lora_adapters={"writer": "writer", "coder": "coder"})
    with pytest.raises(lora.NoSamplesForAdapters, match="planner"):
        lora.split_by_adapter(samples, wrong)
    half = BackendSection(lora_rank=4, lora_adapters={"planner": "planner", "coder": "coder"})
    with caplog.at_level("WARNING", logger="trainer.backends.lora"):
        split = lora.split_by_adapter(samples, half)
    assert {k: len(v) for k, v in split.items()} == {"planner": 2, "coder": 0}
    assert "adapter 'coder' trains on 0 of the step's 2 samples" in caplog.text
