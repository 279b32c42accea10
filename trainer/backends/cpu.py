"""The CPU training backend: a transformers causal LM updated with torch in this process.

`CpuBackend.update(samples)` takes one optimizer step per `updates_per_step` over the samples of a
step (built by `trainer.core`, weights fixed for the whole step): micro-batches packed by tokens,
the clipped policy loss of `trainer.loss` summed over them (so the gradient is the full step's),
then gradient clipping and AdamW. `save_weights` writes a directory the engine can load
(`model.safetensors`, `config.json`, the tokenizer files), one per weights version; with LoRA,
the adapters (`trainer.backends.lora`) and, for engines that cannot apply them, the merged model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.backends import lora
from trainer.backends.base import UpdateMetrics, combine, contributes, copy_tokenizer_files, replace_dir
from trainer.core import Sample, plan_micro_batches
from trainer.forward import policy_logprobs
from trainer.loss import LossMetrics, PolicyBatch, PolicyLossConfig, collate, pack, policy_loss
from trainer.run.sections import AlgorithmSection, BackendSection

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CpuBackend:
    """A causal LM and its AdamW optimizer, updated in this process (see the module docstring).

    `device` defaults to the CPU; the benchmark moves the same code to CUDA.
    """

    is_main = True

    def __init__(
        self,
        model_dir: Path,
        algorithm: AlgorithmSection,
        *,
        seed: int = 0,
        settings: BackendSection | None = None,
        role_of: lora.RoleOf = lora.sample_role,
        merged_export: bool = True,
        device: str = "cpu",
    ):
        self.settings = settings or BackendSection()
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.algorithm = algorithm
        self.role_of = role_of
        self.merged_export = merged_export
        self.device = torch.device(device)
        self.loss_config = PolicyLossConfig(**msgspec.to_builtins(algorithm.loss))
        self.lora = self.settings.lora_rank > 0
        self.model: Any = self._load(self.model_dir)
        if self.settings.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            self.model = lora.add_adapters(self.model, self.settings, seed=seed)
        self.model.train()
        self.reference: PreTrainedModel | None = None
        if self.loss_config.kl_coef > 0.0 and not self.lora:  # LoRA's reference is the base: adapters off
            self.reference = self._load(self.model_dir)
            self.reference.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.trained_parameters().values(), lr=algorithm.lr, weight_decay=algorithm.weight_decay, betas=(0.9, 0.99)
        )
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if isinstance(pad, int) else 0

    def _load(self, path: Path) -> Any:
        dtype = _DTYPES[self.settings.dtype]
        attention = attention_implementation(self.device, packed=self.settings.pack_sequences)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention)
        return model.to(self.device)  # type: ignore[arg-type]

    def _logprobs(self, model: Any, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return policy_logprobs(model, batch, chunk_tokens=self.settings.logprob_chunk_tokens)

    def _reference_logprobs(self, batch: PolicyBatch) -> torch.Tensor | None:
        if self.loss_config.kl_coef <= 0.0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return self._logprobs(self.reference, batch)[0]
            with self.model.disable_adapter():
                return self._logprobs(self.model, batch)[0]

    def batch(self, samples: Sequence[Sample]) -> PolicyBatch:
        """Samples as one micro-batch on the device: packed in one row (`pack_sequences`), else padded rows."""
        default = self.algorithm.loss_temperature
        if self.settings.pack_sequences:
            return pack(samples, default_temperature=default).to(self.device)
        return collate(samples, pad_id=self.pad_id, default_temperature=default).to(self.device)

    def micro_batch_loss(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, LossMetrics]:
        """The summed policy loss of some samples under the current weights (to backpropagate).

        Each sampled token's logprob is recomputed under the distribution it was drawn from: its
        sample's temperature, top_p and top_k (`trainer.logprobs`), so on policy every ratio is 1.
        """
        batch = self.batch(samples)
        ref = self._reference_logprobs(batch)
        logprobs, entropy = self._logprobs(self.model, batch)  # [B, T']
        return policy_loss(logprobs, batch, self.loss_config, ref_logprobs=ref, entropy=entropy.detach())

    def _groups(self, samples: Sequence[Sample]) -> list[tuple[str | None, list[Sample]]]:
        """(adapter, samples with a gradient) pairs; one pair (None, ...) without LoRA."""
        with_kl = self.loss_config.kl_coef > 0.0
        if not self.lora:
            return [(None, [s for s in samples if contributes(s, with_kl=with_kl)])]
        split = lora.split_by_adapter(samples, self.settings, self.role_of)
        return [(name, [s for s in group if contributes(s, with_kl=with_kl)]) for name, group in split.items()]

    def update(self, samples: Sequence[Sample]) -> UpdateMetrics:
        """`updates_per_step` optimizer steps on the step's samples; returns the token-weighted metrics."""
        start = time.monotonic()
        groups = [(name, trained) for name, trained in self._groups(samples) if trained]
        plans = [
            (
                name,
                trained,
                plan_micro_batches(
                    [len(s.tokens) for s in trained], workers=1, max_tokens=self.algorithm.micro_batch_tokens
                )[0],
            )
            for name, trained in groups
        ]
        parts: list[LossMetrics] = []
        grad_norm, steps = 0.0, 0
        for _ in range(self.algorithm.updates_per_step if plans else 0):
            self.optimizer.zero_grad(set_to_none=True)
            for name, trained, plan in plans:
                if name is not None:
                    self.model.set_adapter(name)
                for indices in plan:
                    loss, metrics = self.micro_batch_loss([trained[i] for i in indices])
                    loss.backward()
                    parts.append(metrics)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.algorithm.grad_clip))
            self.optimizer.step()
            steps += 1
        return combine(
            parts,
            samples=sum(len(t) for _, t in groups),
            micro=len(parts),
            steps=steps,
            grad_norm=grad_norm,
            seconds=time.monotonic() - start,
        )

    def token_logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray | None]:
        """Each sample's per-token logprobs under the current weights, without a gradient (None: not trained).

        Entry t is log p(token t | tokens before it) under the sample's recorded temperature, top_p and
        top_k (0 at t = 0 and outside the sampled tokens), like
        `Sample.logprobs`. The samples run in the very micro-batches `update` would run them in, so
        the values are those of `update`'s first forward pass: off-policy re-training takes them as
        the proximal policy (`trainer.retrain`).
        """
        found: list[np.ndarray | None] = [None] * len(samples)
        position = {id(s): i for i, s in enumerate(samples)}
        with torch.no_grad():
            for name, trained in self._groups(samples):
                if name is not None:
                    self.model.set_adapter(name)
                sizes = [len(s.tokens) for s in trained]
                for indices in plan_micro_batches(sizes, workers=1, max_tokens=self.algorithm.micro_batch_tokens)[0]:
                    part = [trained[i] for i in indices]
                    rows = self._micro_batch_logprobs(part)  # [B, T-1]
                    for row, sample in enumerate(part):
                        found[position[id(sample)]] = np.concatenate([[0.0], rows[row, : len(sample.tokens) - 1]])
        return found

    def _micro_batch_logprobs(self, samples: Sequence[Sample]) -> np.ndarray:
        """Target-aligned logprobs [B, T-1] of some samples, computed as `micro_batch_loss` computes them
        (each sample's temperature, top_p and top_k); positions outside the loss mask are 0."""
        batch = collate(samples, pad_id=self.pad_id, default_temperature=self.algorithm.loss_temperature)
        logprobs, _ = self._logprobs(self.model, batch.to(self.device))
        return logprobs.double().cpu().numpy()

    def loss_and_gradients(self, samples: Sequence[Sample]) -> tuple[float, dict[str, torch.Tensor]]:
        """The step's loss and gradient per trained parameter, without stepping (tests, debugging)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for name, trained in self._groups(samples):
            if name is not None:
                self.model.set_adapter(name)
            sizes = [len(s.tokens) for s in trained]
            for indices in plan_micro_batches(sizes, workers=1, max_tokens=self.algorithm.micro_batch_tokens)[0]:
                loss, metrics = self.micro_batch_loss([trained[i] for i in indices])
                loss.backward()
                total += metrics.loss
        grads = {n: p.grad.detach().clone() for n, p in self.trained_parameters().items() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return total, grads

    def save_weights(self, out_dir: Path) -> Path:
        """Write the current weights as a loadable model directory (safetensors) at `out_dir`."""
        out_dir = Path(out_dir)
        staging = out_dir.with_name(f".{out_dir.name}.partial")
        replace_dir_clean(staging)
        if self.lora:
            names = lora.adapter_names(self.settings)
            for name in names:
                lora.save_adapter(self.model, name, staging)
            if self.merged_export and len(names) == 1:
                lora.save_merged(self.model, names[0], staging)
        else:
            self.model.save_pretrained(staging, safe_serialization=True)
        copy_tokenizer_files(self.model_dir, staging)
        return replace_dir(staging, out_dir)

    def load_weights(self, model_dir: Path) -> None:
        """Replace the current weights by those saved in `model_dir` (same architecture, same adapters)."""
        if self.lora:
            lora.load_adapter_tensors(self.model, Path(model_dir))
            return
        loaded = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=torch.float32)
        self.model.load_state_dict(loaded.state_dict())

    def state(self) -> dict[str, Any]:
        """The optimizer state and torch RNG state, for a checkpoint (weights are saved separately)."""
        return {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])

    def follow(self) -> None:
        """One process, one rank: there is nothing to follow."""

    def close(self) -> None:
        """Nothing to release beyond what garbage collection does."""

    def trained_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the optimizer updates: every weight, or every adapter's (LoRA)."""
        named = self.model.named_parameters()
        return {name: p for name, p in named if not self.lora or "lora_" in name}

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every trained parameter (tests compare before and after an update)."""
        return {name: p.detach().clone() for name, p in self.trained_parameters().items()}


def attention_implementation(device: torch.device, *, packed: bool) -> str:
    """flash-attn 2 (its varlen kernels run packed rows) on CUDA where installed, else PyTorch's sdpa
    (packed rows get a block-diagonal causal mask from their restarting positions)."""
    if device.type != "cuda" or not packed:
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_attention_2"


def replace_dir_clean(staging: Path) -> None:
    """An empty `staging` directory (a leftover of a crashed save is removed first)."""
    import shutil

    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
