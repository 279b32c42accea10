"""The training backend protocol, and the factory that builds the one a run's `[backend] kind` names.

A backend owns the policy's weights and optimizer. The loop only ever calls:

    update(samples)        `updates_per_step` optimizer steps on one step's samples -> UpdateMetrics
    save_weights(dir)      a directory the serving engines load (safetensors; see `WeightsLayout`)
    load_weights(dir)      replace the weights by a saved version (resuming)
    state() / load_state() optimizer and RNG state for a checkpoint
    is_main, follow(), close()   multi-rank training: rank 0 runs the loop and calls the methods
                           above; every other rank calls `follow()`, which runs the same collective
                           work on the samples rank 0 hands out, until rank 0 calls `close()`

Backends:

- `cpu` (`trainer.backends.cpu.CpuBackend`): torch + transformers in this process.
- `verl` (`trainer.backends.verl.VerlBackend`): verl's FSDP2 training engine, one process per GPU
  under torchrun (several nodes through torchrun's rendezvous), our loss passed to it exactly.

Both train every weight or, with `lora_rank > 0`, LoRA adapters (`trainer.backends.lora`): one adapter for
all calls, or one per agent role (`lora_adapters`), on one base model.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from trainer.core import Sample
from trainer.loss import LossMetrics

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
ADAPTERS_DIR = "adapters"  # LoRA: <weights dir>/adapters/<adapter name>/ (peft format)


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


class TrainingBackend(Protocol):
    """What the loop needs of a backend (see the module docstring)."""

    is_main: bool

    def update(self, samples: Sequence[Sample]) -> UpdateMetrics:
        """Optimizer steps on one step's samples."""
        ...

    def save_weights(self, out_dir: Path) -> Path:
        """Write the weights the engines serve next."""
        ...

    def load_weights(self, model_dir: Path) -> None:
        """Replace the weights by a saved version."""
        ...

    def state(self) -> dict[str, Any]:
        """Optimizer and RNG state for a checkpoint."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""
        ...

    def follow(self) -> None:
        """On a rank other than 0: take part in rank 0's calls until it closes."""
        ...

    def close(self) -> None:
        """Release the backend (rank 0 also releases the ranks following it)."""
        ...


def combine(
    parts: Sequence[LossMetrics], *, samples: int, micro: int, steps: int, grad_norm: float, seconds: float
) -> UpdateMetrics:
    """One `UpdateMetrics` from the micro-batches' `LossMetrics` of an update (token-weighted means)."""

    def mean(field: str, of: Sequence[LossMetrics] = parts) -> float:
        total = sum(p.tokens for p in of)
        return sum(float(getattr(p, field) or 0.0) * p.tokens for p in of) / total if total else 0.0

    kl = [p for p in parts if p.kl_ref is not None]
    return UpdateMetrics(
        loss=sum(p.loss for p in parts) / max(steps, 1),
        tokens=sum(p.tokens for p in parts) // max(steps, 1),
        samples=samples,
        micro_batches=micro,
        optimizer_steps=steps,
        clip_fraction=mean("clip_fraction"),
        dual_clip_fraction=mean("dual_clip_fraction"),
        ratio_mean=mean("ratio_mean"),
        approx_kl=mean("approx_kl"),
        entropy=mean("entropy"),
        kl_ref=mean("kl_ref", kl) if kl else None,
        grad_norm=grad_norm,
        seconds=seconds,
    )


def contributes(sample: Sample, *, with_kl: bool) -> bool:
    """Whether a sample has a gradient: sampled tokens with weight, and an advantage or a KL term.

    A sample with advantage 0 (a group whose rewards were all equal) has no policy gradient, so it
    is not run at all; and a step where no sample contributes takes no optimizer step, since AdamW
    would still move every weight along its momentum. Loss weights were fixed over the whole step,
    so leaving such samples out changes nothing in the others' contribution.
    """
    if sample.response_tokens == 0 or sample.token_weight <= 0.0:
        return False
    return sample.advantage != 0.0 or with_kl


def copy_tokenizer_files(source: Path, target: Path) -> None:
    """Copy the tokenizer and chat template files of a model directory next to saved weights."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


def replace_dir(staging: Path, out_dir: Path) -> Path:
    """Move a fully written `staging` directory to `out_dir` (replacing it), so readers never see half a save."""
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir
