"""Loading a saved causal LM for serving, and what the engine needs to know about it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from services.common.tinymodel.tokenizer import ModelLoadError


def cache_argument(model: torch.nn.Module) -> str:
    """The name `model.forward` takes the KV cache under (`cache` in recent transformers, else `past_key_values`)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _batchable(model: PreTrainedModel) -> bool:
    """Whether requests can share a left-padded KV cache: full attention everywhere, per-layer tensors exposed."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    full = all(kind == "full_attention" for kind in layer_types) and not getattr(config, "use_sliding_window", False)
    return full and hasattr(DynamicCache(), "layers")


@dataclass(frozen=True)
class Weights:
    """A loaded model, the weights version it holds, and how to drive it."""

    model: PreTrainedModel
    version: int
    path: Path
    cache_arg: str
    batchable: bool

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: every id the model can sample."""
        return int(self.model.config.vocab_size)


def load_weights(path: Path, version: int) -> Weights:
    """Load a saved causal LM (float32, eval mode) from `path`."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a saved model directory (no config.json); pass a save_pretrained output")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"could not load a causal LM from {path}: {exc}") from exc
    model.eval()
    return Weights(
        model=model, version=version, path=path, cache_arg=cache_argument(model), batchable=_batchable(model)
    )
