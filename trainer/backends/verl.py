"""The verl backend: verl's FSDP2 training engine, driven by Rollwire's micro-batches and loss.

One process per GPU under `torchrun` (several nodes through torchrun's rendezvous). Rank 0 runs
the training loop; every other rank runs `follow()`, which receives each call rank 0 makes
(`update`, `save_weights`, ...) by `broadcast_object_list` and does its share of the collective
work. An update spreads the step's samples over the ranks with `trainer.core.plan_micro_batches`
(balanced by tokens, packed into micro-batches of at most `micro_batch_tokens`, the same count
on every rank; a rank with fewer runs a filler that contributes nothing), runs each micro-batch
through the engine's `forward_backward_batch` with Rollwire's loss (`trainer.backends.verl_batch`), and
takes `updates_per_step` optimizer steps (clipping and AdamW in the engine).

On GPUs: bf16 compute (`[backend] dtype`) over float32 master weights, gradient checkpointing,
padding-free micro-batches (flash-attention varlen through verl's patches). Token logprobs come
from Rollwire's chunked path run inside the output projection (`trainer.logprobs`,
`trainer.backends.verl_engine.rollwire_forward_step`), under each sample's temperature and nucleus, never
from verl's per-row `logprobs_from_logits_v2` loop. On CPU (tests):
verl's platform registry gets a `cpu` platform (`trainer.backends.verl_platform`), sdpa attention and
gloo; the same FSDP2 code runs and matches the CPU backend to float32 rounding.

Weights are exported as a Hugging Face safetensors directory (`model.safetensors`,
`config.json`, tokenizer files) that vLLM loads; with LoRA, each adapter in peft's format
(`trainer.backends.lora`), plus the merged model for whatever loads plain weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from trainer.backends import lora
from trainer.backends.base import UpdateMetrics, combine, contributes, copy_tokenizer_files, replace_dir
from trainer.backends.cpu import replace_dir_clean
from trainer.backends.verl_batch import FILLER, policy_loss_function, reference_rows, to_tensordict
from trainer.backends.verl_engine import (
    build_engine,
    build_reference_model,
    full_state,
    load_full_state,
    optimizer_state,
    reference_from_model,
    set_optimizer_state,
)
from trainer.backends.verl_platform import init_distributed, register_cpu_platform
from trainer.core import Sample, plan_micro_batches
from trainer.loss import LossMetrics, PolicyLossConfig
from trainer.run.sections import AlgorithmSection, BackendSection


class VerlBackend:
    """verl's FSDP2 engine behind the backend protocol (see the module docstring)."""

    def __init__(
        self,
        model_dir: Path,
        algorithm: AlgorithmSection,
        *,
        seed: int = 0,
        settings: BackendSection | None = None,
        role_of: lora.RoleOf = lora.sample_role,
        merged_export: bool = True,
    ) -> None:
        self.settings = settings or BackendSection()
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        self.on_cpu = register_cpu_platform()
        self.rank, self.world = init_distributed(self.on_cpu)
        self.is_main = self.rank == 0
        self.model_dir = Path(model_dir)
        self.algorithm = algorithm
        self.role_of = role_of
        self.merged_export = merged_export
        self.loss_config = PolicyLossConfig(**msgspec.to_builtins(algorithm.loss))
        self.lora = self.settings.lora_rank > 0
        torch.manual_seed(seed)
        self.engine = build_engine(self.model_dir, algorithm, self.settings, on_cpu=self.on_cpu, seed=seed)
        self.reference: Any = None
        if self.loss_config.kl_coef > 0.0 and not self.lora:  # LoRA's reference is the base: adapters off
            # On GPUs a forward-only engine (sharded, CPU-offloaded); on CPU, where FSDP's offload
            # policy needs pinned memory, the plain model.
            self.reference = (
                build_reference_model(self.model_dir)
                if self.on_cpu
                else build_engine(self.model_dir, algorithm, self.settings, on_cpu=False, seed=seed, forward_only=True)
            )

    # ---- rank 0 calls these; the others follow -------------------------------------------------

    def _lead(self, command: str, argument: Any = None) -> None:
        if self.world > 1 and self.is_main:
            dist.broadcast_object_list([(command, argument)], src=0)

    def update(self, samples: Sequence[Sample]) -> UpdateMetrics:
        """`updates_per_step` optimizer steps on the step's samples, spread over every rank."""
        self._lead("update", list(samples))
        return self._update(list(samples))

    def token_logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray | None]:
        """Each sample's per-token logprobs under the current weights (None: not trained), every rank taking part.

        Entry t is log p(token t | tokens before it), 0 at t = 0, like `Sample.logprobs`: the
        proximal policy of off-policy re-training (`trainer.retrain`).
        """
        self._lead("token_logprobs", list(samples))
        return self._token_logprobs(list(samples))

    def save_weights(self, out_dir: Path) -> Path:
        """Write the weights as a safetensors HF directory (LoRA: the adapters) at `out_dir` (rank 0 writes)."""
        self._lead("save_weights", str(out_dir))
        return self._save(Path(out_dir))

    def load_weights(self, model_dir: Path) -> None:
        """Replace the weights by a saved version (every rank reads it)."""
        self._lead("load_weights", str(model_dir))
        self._load(Path(model_dir))

    def state(self) -> dict[str, Any]:
        """The full (unsharded) optimizer state and the RNG state, gathered on rank 0."""
        self._lead("state")
        return {"optimizer": optimizer_state(self.engine), "torch_rng": torch.get_rng_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned (rank 0 hands it to every rank)."""
        self._lead("load_state", state)
        set_optimizer_state(self.engine, state["optimizer"])
        torch.set_rng_state(state["torch_rng"])

    def close(self) -> None:
        """Release the ranks that follow this one."""
        self._lead("close")

    def follow(self) -> None:
        """On ranks other than 0: do each call rank 0 makes, until it closes."""
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, src=0)
            command, argument = message[0]
            match command:
                case "update":
                    self._update(argument)
                case "save_weights":
                    self._save(Path(argument))
                case "load_weights":
                    self._load(Path(argument))
                case "state":
                    optimizer_state(self.engine)
                case "load_state":
                    set_optimizer_state(self.engine, argument["optimizer"])
                case "token_logprobs":
                    self._token_logprobs(argument)
                case "close":
                    return

    # ---- the collective work -------------------------------------------------------------------

    def _groups(self, samples: Sequence[Sample]) -> list[tuple[str | None, list[Sample]]]:
        with_kl = self.loss_config.kl_coef > 0.0
        split = lora.split_by_adapter(samples, self.settings, self.role_of) if self.lora else {None: list(samples)}
        groups = [(name, [s for s in group if contributes(s, with_kl=with_kl)]) for name, group in split.items()]
        return [(name, trained) for name, trained in groups if trained]

    def _my_micro_batches(self, trained: Sequence[Sample]) -> list[list[Sample]]:
        """This rank's micro-batches of a group (a filler where another rank has one more)."""
        sizes = [len(s.tokens) for s in trained]
        plan = plan_micro_batches(sizes, workers=self.world, max_tokens=self.algorithm.micro_batch_tokens)[self.rank]
        return [[trained[i] for i in indices] or [FILLER] for indices in plan]

    def _reference(self, batch: Sequence[Sample], adapter: str | None) -> list[torch.Tensor] | None:
        if self.loss_config.kl_coef <= 0.0:
            return None
        if isinstance(self.reference, torch.nn.Module):
            return reference_from_model(self.reference, batch, self.algorithm.loss_temperature)
        data = to_tensordict(batch, temperature=self.algorithm.loss_temperature, entropy=False)
        if self.reference is not None:
            with self.reference.eval_mode():
                output = self.reference.infer_batch(data)
        else:
            with self.engine.eval_mode(), self.engine.disable_adapter():
                output = self.engine.infer_batch(data)
        return reference_rows(output["model_output"])

    def _update(self, samples: list[Sample]) -> UpdateMetrics:
        start = time.monotonic()
        plans = self._plans(samples)
        parts: list[LossMetrics] = []
        grad_norm, steps = 0.0, 0
        with self.engine.train_mode():
            for _ in range(self.algorithm.updates_per_step if plans else 0):
                self.engine.optimizer_zero_grad()
                self._accumulate(plans, parts)
                grad_norm = float(self.engine.optimizer_step())
                steps += 1
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, parts)
        everything = [p for rank_parts in gathered for p in rank_parts if p.tokens]
        return combine(
            everything,
            samples=sum(len(t) for _, t in self._groups(samples)),
            micro=len(everything),
            steps=steps,
            grad_norm=grad_norm,
            seconds=time.monotonic() - start,
        )

    def _plans(self, samples: Sequence[Sample]) -> list[tuple[str | None, list[tuple[list[Sample], Any]]]]:
        """Per adapter group: this rank's micro-batches with their reference logprobs (fixed for the step)."""
        plans = []
        for name, trained in self._groups(samples):
            self._select(name)
            plans.append((name, [(mb, self._reference(mb, name)) for mb in self._my_micro_batches(trained)]))
        return plans

    def _accumulate(
        self, plans: Sequence[tuple[str | None, list[tuple[list[Sample], Any]]]], parts: list[LossMetrics]
    ) -> None:
        """Forward and backward over this rank's micro-batches: the step's gradient, summed."""
        loss_fn = policy_loss_function(self.loss_config, self.engine.get_data_parallel_size(), parts)
        for name, micro_batches in plans:
            self._select(name)
            for batch, ref in micro_batches:
                data = to_tensordict(batch, temperature=self.algorithm.loss_temperature, ref_log_probs=ref)
                self.engine.forward_backward_batch(data, loss_fn)

    def loss_and_gradients(self, samples: Sequence[Sample]) -> tuple[float, dict[str, torch.Tensor]]:
        """The step's loss and full gradient per trained parameter, without stepping (one rank; tests, debugging)."""
        from trainer.backends.verl_engine import _full

        parts: list[LossMetrics] = []
        plans = self._plans(samples)
        with self.engine.train_mode():  # zeroes the gradients on exit
            self.engine.optimizer_zero_grad()
            self._accumulate(plans, parts)
            grads = {n: _full(p.grad) for n, p in self.engine.module.named_parameters() if p.grad is not None}
        return sum(p.loss for p in parts), grads

    def _token_logprobs(self, samples: list[Sample]) -> list[np.ndarray | None]:
        """`token_logprobs`' collective work: this rank's micro-batches through `infer_batch`, gathered."""
        position = {id(s): i for i, s in enumerate(samples)}
        mine: dict[int, np.ndarray] = {}
        with self.engine.eval_mode():
            for name, trained in self._groups(samples):
                self._select(name)
                for batch in self._my_micro_batches(trained):
                    if batch[0] is FILLER:
                        continue
                    data = to_tensordict(batch, temperature=self.algorithm.loss_temperature, entropy=False)
                    rows = reference_rows(self.engine.infer_batch(data)["model_output"])
                    for sample, row in zip(batch, rows, strict=True):  # row t: token t+1 (the last wraps)
                        mine[position[id(sample)]] = np.concatenate([[0.0], row[:-1].double().cpu().numpy()])
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        found: list[np.ndarray | None] = [None] * len(samples)
        for part in gathered:
            for i, row in part.items():
                found[i] = row
        return found

    def _select(self, adapter: str | None) -> None:
        if adapter is not None and len(lora.adapter_names(self.settings)) > 1:
            self.engine.module.set_adapter(adapter)

    def _save(self, out_dir: Path) -> Path:
        staging = out_dir.with_name(f".{out_dir.name}.partial")
        if self.is_main:
            replace_dir_clean(staging)
        if self.lora:
            for name in lora.adapter_names(self.settings):
                tensors = full_state(self.engine, adapter=name)
                if self.is_main:
                    lora.save_adapter(self.engine.module, name, staging, tensors)
        if not self.lora or (self.merged_export and len(lora.adapter_names(self.settings)) == 1):
            tensors = full_state(self.engine, merged=self.lora)
            if self.is_main:
                from safetensors.torch import save_file

                save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
                self.engine.model_config.hf_config.save_pretrained(str(staging))
        if not self.is_main:
            return out_dir
        copy_tokenizer_files(self.model_dir, staging)
        return replace_dir(staging, out_dir)

    def _load(self, model_dir: Path) -> None:
        if self.lora:
            from safetensors.torch import load_file

            for name in lora.adapter_names(self.settings):
                path = model_dir / lora.ADAPTERS_DIR / name / "adapter_model.safetensors"
                load_full_state(self.engine, load_file(str(path)), adapter=name)
            return
        from safetensors.torch import load_file

        load_full_state(self.engine, load_file(str(model_dir / "model.safetensors")))

    def parameters_snapshot(self) -> dict[str, torch.Tensor]:
        """A full copy of every trained parameter under its HF name (collective; tests compare them)."""
        if self.lora:
            return {
                f"{name}/{k}": v
                for name in lora.adapter_names(self.settings)
                for k, v in full_state(self.engine, adapter=name).items()
            }
        return full_state(self.engine)
