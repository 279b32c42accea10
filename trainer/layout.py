"""Which GPUs train and which serve, and whether that fits in their memory (`rollwire train --check`).

`[backend] gpus` lists the GPU indices of the training ranks (one rank per GPU, under torchrun),
`[engine] gpus` those of the vLLM replicas (split evenly: each replica's share is its tensor-parallel
size), `[backend] gpu_memory_gb` the memory of one GPU. A GPU may hold both: vLLM then takes
`gpu_memory_utilization` of it and training gets the rest.

The arithmetic (per training GPU, verl's FSDP2 engine: float32 master weights sharded over the
ranks, bf16 compute, AdamW):

    weights      4 B x P / ranks           (LoRA: the frozen base, float32, sharded the same way)
    gradients    4 B x P_trained / ranks
    Adam         8 B x P_trained / ranks   (two float32 moments)
    activations  checkpointed: 2 B x tokens x hidden x layers (each layer's input, bf16)
                 + 34 B x tokens x hidden (one layer recomputed in the backward)
                 without checkpointing: 34 B x tokens x hidden x layers
                 + 12 B x chunk x vocabulary (one chunk of float32 logits, its softmax and gradient)
    runtime      2 GB (CUDA context, allocator slack, NCCL buffers)

with tokens = `micro_batch_tokens` (one packed micro-batch). A vLLM replica needs its bf16 weights
(2 B x P / tensor-parallel) inside its `gpu_memory_utilization` share, with at least a fifth of
that share left for the KV cache. The numbers are estimates, on the safe side for the KV cache and
the optimizer; they catch layouts that cannot fit, not ones that barely do.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from trainer.run.sections import TrainConfig

GB = 1e9
RUNTIME_GB = 2.0
KV_SHARE = 0.2  # the least part of vLLM's share left for the KV cache after its weights


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """What the arithmetic needs of a model: parameters, hidden size, layers, vocabulary."""

    params: float
    hidden: int
    layers: int
    vocab: int
    source: str


# Qwen2.5 shapes by size (billions): used when the model directory is not on this machine.
_KNOWN = {
    0.5: (896, 24),
    1.5: (1536, 28),
    3.0: (2048, 36),
    7.0: (3584, 28),
    14.0: (5120, 48),
    32.0: (5120, 64),
    72.0: (8192, 80),
}
_EXACT = {0.5: 0.494e9, 1.5: 1.544e9, 3.0: 3.086e9, 7.0: 7.616e9, 14.0: 14.77e9, 32.0: 32.76e9, 72.0: 72.7e9}


def model_shape(path: str) -> ModelShape | None:
    """The model's shape from its `config.json`, else from a size in its name (`...-1.5B-...`), else None."""
    config = Path(path) / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        kv = c.get("num_key_value_heads", c["num_attention_heads"]) * h // c["num_attention_heads"]
        per_layer = h * h * 2 + 2 * h * kv + 3 * h * c["intermediate_size"]
        params = layers * per_layer + vocab * h * (1 if c.get("tie_word_embeddings") else 2)
        return ModelShape(params=params, hidden=h, layers=layers, vocab=vocab, source=str(config))
    match = re.search(r"(\d+(?:\.\d+)?)[Bb](?![a-zA-Z])", Path(path).name)
    if not match:
        return None
    size = float(match.group(1))
    nearest = min(_KNOWN, key=lambda k: abs(k - size))
    hidden, layers = _KNOWN[nearest]
    params = _EXACT[nearest] if nearest == size else size * 1e9
    return ModelShape(params=params, hidden=hidden, layers=layers, vocab=151_936, source=f"the name ({size}B)")


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    """One training GPU's memory, term by term (GB), and what it has."""

    weights: float
    gradients: float
    adam: float
    activations: float
    runtime: float
    vllm_share: float
    gpu: float

    @property
    def needed(self) -> float:
        """Everything training needs on the GPU."""
        return self.weights + self.gradients + self.adam + self.activations + self.runtime

    @property
    def available(self) -> float:
        """The GPU's memory less vLLM's share where a replica shares it."""
        return self.gpu - self.vllm_share


def training_budget(config: TrainConfig, shape: ModelShape) -> Budget:
    """The per-GPU memory of the training ranks (module docstring), with vLLM's share where a GPU is shared."""
    backend, engine, algorithm = config.backend, config.engine, config.algorithm
    ranks = max(1, len(backend.gpus))
    trained = shape.params
    if backend.lora_rank > 0:  # ~ rank x (in + out) per adapted matrix: 7 per layer, about 2 hidden wide
        trained = (
            len(backend.lora_adapters.values() or ["default"])
            * shape.layers
            * 7
            * backend.lora_rank
            * 4
            * (shape.hidden)
        )
    tokens, h, layers = algorithm.micro_batch_tokens, shape.hidden, shape.layers
    if backend.gradient_checkpointing:
        activations = 2 * tokens * h * layers + 34 * tokens * h
    else:
        activations = 34 * tokens * h * layers
    activations += 12 * min(tokens, backend.logprob_chunk_tokens) * shape.vocab
    shared = engine.kind == "vllm" and bool(set(backend.gpus) & set(engine.gpus))
    return Budget(
        weights=4 * shape.params / ranks / GB,
        gradients=4 * trained / ranks / GB,
        adam=8 * trained / ranks / GB,
        activations=activations / GB,
        runtime=RUNTIME_GB,
        vllm_share=engine.gpu_memory_utilization * backend.gpu_memory_gb if shared else 0.0,
        gpu=backend.gpu_memory_gb,
    )


def replica_gpus(config: TrainConfig) -> int:
    """GPUs per vLLM replica (its tensor-parallel size): `engine.gpus` split over `engine.replicas`."""
    return max(1, len(config.engine.gpus) // max(1, config.engine.replicas))


def check_layout(config: TrainConfig) -> tuple[list[str], list[str]]:
    """(the arithmetic, line by line; the problems, empty when the layout fits)."""
    backend, engine = config.backend, config.engine
    if not backend.gpus:
        return ["no [backend] gpus: the layout is not checked (a CPU run)"], []
    if backend.gpu_memory_gb <= 0:
        return [], ["backend.gpu_memory_gb: give one GPU's memory in GB to check the layout"]
    shape = model_shape(config.model.path)
    if shape is None:
        return [], [f"model.path {config.model.path}: no config.json and no size in its name; cannot size it"]
    budget = training_budget(config, shape)
    kind = f"LoRA rank {backend.lora_rank}" if backend.lora_rank else "full fine-tune"
    lines = [
        f"model: {shape.params / 1e9:.2f}B parameters (from {shape.source}), hidden {shape.hidden}, "
        f"{shape.layers} layers, vocabulary {shape.vocab:,}; {kind}",
        f"training: {len(backend.gpus)} rank(s) on GPUs {backend.gpus}, {backend.gpu_memory_gb:g} GB each; "
        f"micro-batch {config.algorithm.micro_batch_tokens:,} tokens, gradient checkpointing "
        f"{'on' if backend.gradient_checkpointing else 'off'}",
        f"  weights {budget.weights:.1f} + gradients {budget.gradients:.1f} + Adam {budget.adam:.1f} + activations "
        f"{budget.activations:.1f} + runtime {budget.runtime:.1f} = {budget.needed:.1f} GB per GPU",
        f"  available: {budget.gpu:g} GB - vLLM's share {budget.vllm_share:.1f} = {budget.available:.1f} GB",
    ]
    problems = []
    if budget.needed > budget.available:
        problems.append(
            f"training needs {budget.needed:.1f} GB per GPU (weights {budget.weights:.1f}, gradients "
            f"{budget.gradients:.1f}, Adam {budget.adam:.1f}, activations {budget.activations:.1f}, runtime "
            f"{budget.runtime:.1f}) but a GPU has {budget.available:.1f} GB ({budget.gpu:g} GB less vLLM's share "
            f"{budget.vllm_share:.1f})"
        )
    if engine.kind == "vllm":
        problems += _check_replicas(config, shape, lines)
    return lines, problems


def _check_replicas(config: TrainConfig, shape: ModelShape, lines: list[str]) -> list[str]:
    engine, backend = config.engine, config.backend
    if not engine.gpus:
        return ["engine.gpus: say which GPUs the vLLM replicas use (they may be the training GPUs)"]
    if len(engine.gpus) % engine.replicas:
        return [f"engine.gpus: {len(engine.gpus)} GPUs do not split evenly over {engine.replicas} replicas"]
    tp = replica_gpus(config)
    share = engine.gpu_memory_utilization * backend.gpu_memory_gb
    weights = 2 * shape.params / tp / GB
    lines.append(
        f"vLLM: {engine.replicas} replica(s) x {tp} GPU(s) on GPUs {engine.gpus}; per GPU: share "
        f"{engine.gpu_memory_utilization:g} x {backend.gpu_memory_gb:g} = {share:.1f} GB, bf16 weights "
        f"{weights:.1f} GB, KV cache {share - weights:.1f} GB"
    )
    if weights > (1 - KV_SHARE) * share:
        return [
            f"vLLM: a replica's bf16 weights are {weights:.1f} GB per GPU ({tp} GPU(s) per replica) but its share is "
            f"{share:.1f} GB ({engine.gpu_memory_utilization:g} x {backend.gpu_memory_gb:g}), which must keep "
            f"{KV_SHARE:.0%} for the KV cache"
        ]
    return []
