"""The CPU training backend: a transformers causal LM updated with torch in this process.

`CpuBackend.update(samples)` takes one optimizer step per `updates_per_step` over the samples of a
step (built by `trainer.core`, weights fixed for the whole step): micro-batches packed by tokens,
the clipped policy loss of `trainer.loss` summed over them (so the gradient is the full step's),
then gradient clipping and AdamW. `save_weights` writes a directory the engine can load
(`model.safetensors`, `config.json`, the tokenizer files), one per weights version.

The GPU backend (verl + vLLM) comes later behind the same interface: `update`, `save_weights`,
`state`/`load_state`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.config import AlgorithmSection
from trainer.core import Sample, plan_micro_batches
from trainer.forward import forward_logits
from trainer.loss import LossMetrics, PolicyLossConfig, collate, policy_loss, token_logprobs

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


class UpdateMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What one `update` did: the loss per optimizer step, and token-weighted means over its micro-batches.

    `grad_norm` is the norm before clipping of the last optimizer step.
    """

    loss: float
    tokens: int
    samples: int
    micro_batches: int
    optimizer_steps: int
    clip_fraction: float
    dual_clip_fraction: float
    ratio_mean: float
    approx_kl: float
    entropy: float
    kl_ref: float | None
    grad_norm: float
    seconds: float


def _mean(parts: Sequence[LossMetrics], field: str) -> float:
    total = sum(p.tokens for p in parts)
    return sum(float(getattr(p, field) or 0.0) * p.tokens for p in parts) / total if total else 0.0


def copy_tokenizer_files(source: Path, target: Path) -> None:
    """Copy the tokenizer and chat template files of a model directory next to saved weights."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


class CpuBackend:
    """A causal LM and its AdamW optimizer, updated on this machine's CPU (see the module docstring)."""

    def __init__(self, model_dir: Path, algorithm: AlgorithmSection, *, seed: int = 0, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.algorithm = algorithm
        self.loss_config = PolicyLossConfig(**msgspec.to_builtins(algorithm.loss))
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.train()
        self.reference: PreTrainedModel | None = None
        if self.loss_config.kl_coef > 0.0:
            self.reference = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            self.reference.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=algorithm.lr, weight_decay=algorithm.weight_decay, betas=(0.9, 0.99)
        )
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if isinstance(pad, int) else 0

    def _micro_batch(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, LossMetrics]:
        batch = collate(samples, pad_id=self.pad_id, default_temperature=self.algorithm.loss_temperature)
        logits = forward_logits(self.model, batch.input_ids, batch.attention_mask)  # [B, T, V]
        temperature = batch.temperature  # [B, 1, 1]: each sample's own sampling temperature
        logprobs = token_logprobs(logits, batch.input_ids, temperature=temperature)  # [B, T-1]
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = forward_logits(self.reference, batch.input_ids, batch.attention_mask)
                ref = token_logprobs(ref_logits, batch.input_ids, temperature=temperature)
        return policy_loss(logprobs, batch, self.loss_config, ref_logprobs=ref, logits=logits.detach())

    def _contributes(self, sample: Sample) -> bool:
        """Whether a sample has a gradient: sampled tokens with weight, and an advantage or a KL term.

        A sample with advantage 0 (a group whose rewards were all equal) has no policy gradient,
        so it is not run at all; and a step where no sample contributes takes no optimizer step,
        since AdamW would still move every weight along its momentum.
        """
        if sample.response_tokens == 0 or sample.token_weight <= 0.0:
            return False
        return sample.advantage != 0.0 or self.reference is not None

    def update(self, samples: Sequence[Sample]) -> UpdateMetrics:
        """`updates_per_step` optimizer steps on the step's samples; returns the token-weighted metrics.

        Loss weights were fixed over the whole step, so leaving out samples without a gradient
        changes nothing in the others' contribution.
        """
        start = time.monotonic()
        trained = [s for s in samples if self._contributes(s)]
        parts: list[LossMetrics] = []
        grad_norm = 0.0
        steps = 0
        micro = 0
        if trained:
            sizes = [len(s.tokens) for s in trained]
            plan = plan_micro_batches(sizes, workers=1, max_tokens=self.algorithm.micro_batch_tokens)[0]
            for _ in range(self.algorithm.updates_per_step):
                self.optimizer.zero_grad(set_to_none=True)
                for indices in plan:
                    loss, metrics = self._micro_batch([trained[i] for i in indices])
                    loss.backward()
                    parts.append(metrics)
                    micro += 1
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.algorithm.grad_clip)
                grad_norm = float(norm)
                self.optimizer.step()
                steps += 1
        kl = [p for p in parts if p.kl_ref is not None]
        return UpdateMetrics(
            loss=sum(p.loss for p in parts) / max(steps, 1),
            tokens=sum(p.tokens for p in parts) // max(steps, 1),
            samples=len(trained),
            micro_batches=micro,
            optimizer_steps=steps,
            clip_fraction=_mean(parts, "clip_fraction"),
            dual_clip_fraction=_mean(parts, "dual_clip_fraction"),
            ratio_mean=_mean(parts, "ratio_mean"),
            approx_kl=_mean(parts, "approx_kl"),
            entropy=_mean(parts, "entropy"),
            kl_ref=_mean(kl, "kl_ref") if kl else None,
            grad_norm=grad_norm,
            seconds=time.monotonic() - start,
        )

    def save_weights(self, out_dir: Path) -> Path:
        """Write the current weights as a loadable model directory (safetensors) at `out_dir`."""
        out_dir = Path(out_dir)
        staging = out_dir.with_name(f".{out_dir.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        self.model.save_pretrained(staging, safe_serialization=True)
        copy_tokenizer_files(self.model_dir, staging)
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
        return out_dir

    def load_weights(self, model_dir: Path) -> None:
        """Replace the current weights by those saved in `model_dir` (same architecture)."""
        loaded = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=torch.float32)
        self.model.load_state_dict(loaded.state_dict())

    def state(self) -> dict[str, Any]:
        """The optimizer state and torch RNG state, for a checkpoint (weights are saved separately)."""
        return {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter (tests compare before and after an update)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}
