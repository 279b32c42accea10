"""Building verl's FSDP2 engine for a run, and moving full (unsharded) weights and optimizer state in and out.

`build_engine` fills verl's dataclass configs (`HFModelConfig`, `FSDPEngineConfig`,
`FSDPOptimizerConfig`) from `[algorithm]` and `[backend]`: AdamW with the CPU backend's betas,
gradient clipping, a constant learning rate, FSDP2, float32 master weights with `dtype` compute,
padding-free micro-batches. LoRA adapters are added by `trainer.backends.lora` before FSDP wraps the model,
so both backends start from the same adapter weights and per-role adapters share one base.

The state helpers are collective: every rank calls them in the same order; only rank 0 gets the
full tensors (others get empty dicts).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.backends import lora
from trainer.run.sections import AlgorithmSection, BackendSection

_PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


def _engine_class() -> Any:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    class RollwireFSDPEngine(FSDPEngineWithLMHead):
        """verl's engine with Rollwire's LoRA adapters (one per trained role, same init as the CPU backend)."""

        rollwire_settings: BackendSection
        rollwire_seed: int = 0

        def _build_lora_module(self, module: Any) -> Any:
            module.enable_input_require_grads()
            return lora.add_adapters(module, self.rollwire_settings, seed=self.rollwire_seed)

        def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
            """verl's forward step with Rollwire's log-prob path: `trainer.logprobs` inside the output
            projection (chunked, each sample's temperature and nucleus, the sampled positions only)
            instead of full logits and verl's `logprobs_from_logits`."""
            return rollwire_forward_step(self, micro_batch, loss_function, forward_only)

    return RollwireFSDPEngine


def rollwire_forward_step(engine: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
    """One micro-batch through the engine's model, returning (loss, verl's output dict); see `_engine_class`."""
    from contextlib import nullcontext

    from verl.utils.device import get_device_id, get_device_name

    from trainer.backends.verl_batch import packed_request
    from trainer.logprobs import computing_in_head

    micro_batch = micro_batch.to(get_device_id())
    model_inputs, _ = engine.prepare_model_inputs(micro_batch=micro_batch)
    targets, sampling, select = packed_request(micro_batch)
    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    autocast: Any = nullcontext() if dtype == torch.float32 else torch.autocast(get_device_name(), dtype=dtype)
    chunk = engine.rollwire_settings.logprob_chunk_tokens
    with autocast:
        with computing_in_head(engine.module, targets, sampling, select, chunk_tokens=chunk):
            packed = engine.module(**model_inputs, use_cache=False).logits[0, : targets.shape[0]].float()  # [N, 2]
        offsets = micro_batch["input_ids"].offsets()
        model_output = {
            "log_probs": torch.nested.nested_tensor_from_jagged(packed[:, 0], offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(packed[:, 1].detach(), offsets),
        }
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=None)
        else:
            loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
    detached = {k: v.detach() for k, v in model_output.items()}
    return loss, {"model_output": detached, "loss": loss.detach().item(), "metrics": metrics}


def build_engine(
    model_dir: Path,
    algorithm: AlgorithmSection,
    settings: BackendSection,
    *,
    on_cpu: bool,
    seed: int,
    forward_only: bool = False,
) -> Any:
    """An initialised engine on `model_dir` (a reference policy when `forward_only`)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    precision = _PRECISION[settings.dtype]
    model_config = HFModelConfig(
        path=str(model_dir),
        load_tokenizer=False,
        use_remove_padding=True,
        enable_gradient_checkpointing=settings.gradient_checkpointing and not forward_only,
        override_config={"attn_implementation": "sdpa" if on_cpu else _gpu_attention()},
        lora_rank=0 if forward_only else settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        target_modules=list(settings.lora_target_modules),
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        model_dtype="fp32",
        mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_torch_compile=False,
        forward_only=forward_only,
        offload_policy=False,
        seed=seed,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=algorithm.lr,
        weight_decay=algorithm.weight_decay,
        betas=(0.9, 0.99),
        clip_grad=algorithm.grad_clip,
        total_training_steps=1 << 30,
        lr_scheduler_type="constant",
    )
    engine_class = _engine_class()
    engine = engine_class(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    engine.rollwire_settings = settings
    engine.rollwire_seed = seed
    engine.initialize()
    return engine


def build_reference_model(model_dir: Path) -> torch.nn.Module:
    """The frozen reference policy as a plain transformers model (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def reference_from_model(model: torch.nn.Module, samples: Any, temperature: float) -> list[torch.Tensor]:
    """Per-sample reference logprob rows, target-aligned like `trainer.backends.verl_batch` (last column 0)."""
    from trainer.forward import policy_logprobs
    from trainer.loss import collate

    pad = getattr(model.config, "pad_token_id", None)
    batch = collate(samples, pad_id=pad if isinstance(pad, int) else 0, default_temperature=temperature)
    with torch.no_grad():
        logprobs, _ = policy_logprobs(model, batch)  # [B, T-1]
    rows = []
    for row, sample in enumerate(samples):
        aligned = torch.zeros(len(sample.tokens))
        aligned[:-1] = logprobs[row, : len(sample.tokens) - 1]
        rows.append(aligned)
    return rows


def _gpu_attention() -> str:
    """flash-attention 2 where installed (padding-free varlen kernels), else PyTorch's sdpa."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_attention_2"


def _full(value: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    tensor = value.full_tensor() if isinstance(value, DTensor) else value
    return tensor.detach().to("cpu", copy=True).contiguous()


def _base_state(engine: Any) -> dict[str, torch.Tensor]:
    return {name: _full(value) for name, value in engine.module.state_dict().items()}


def _merge(state: dict[str, torch.Tensor], adapter: str, scaling: float) -> dict[str, torch.Tensor]:
    """A peft model's full state with one adapter merged in, under the base model's HF names."""
    merged = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        prefix = key.removesuffix(".base_layer.weight")
        a, b = state.get(f"{prefix}.lora_A.{adapter}.weight"), state.get(f"{prefix}.lora_B.{adapter}.weight")
        merged[name] = value + scaling * (b @ a) if a is not None and b is not None else value
    return merged


def full_state(engine: Any, *, adapter: str | None = None, merged: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors on rank 0: the model's (HF names), one adapter's (peft's saved names), or merged."""
    state = _base_state(engine)
    if merged:
        name = next(iter(engine.module.peft_config))
        config = engine.module.peft_config[name]
        state = _merge(state, name, config.lora_alpha / config.r)
    if adapter is None and getattr(engine.model_config.hf_config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding's: saved once, as transformers does
    if adapter is not None:
        pattern = re.compile(rf"\.(lora_[AB])\.{re.escape(adapter)}\.weight$")
        state = {pattern.sub(r".\1.weight", k): v for k, v in state.items() if pattern.search(k)}
    return state if dist.get_rank() == 0 else {}


def load_full_state(engine: Any, tensors: dict[str, torch.Tensor], *, adapter: str | None = None) -> None:
    """Load full tensors (every rank passes the same) into the sharded model; an adapter's by peft names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if adapter is not None:
        tensors = {re.sub(r"\.(lora_[AB])\.weight$", rf".\1.{adapter}.weight", k): v for k, v in tensors.items()}
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(engine.module, dict[str, Any](tensors), options=options)


def optimizer_state(engine: Any) -> dict[str, Any]:
    """The optimizer state gathered unsharded on rank 0 (CPU tensors), for a checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(engine.module, engine.optimizer, options=options)


def set_optimizer_state(engine: Any, state: dict[str, Any]) -> None:
    """Restore `optimizer_state`'s result (given on every rank) into the sharded optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(engine.module, engine.optimizer, state, options=StateDictOptions(full_state_dict=True))
