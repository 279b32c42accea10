"""Samples in verl's batch format, and Rollwire's policy loss as the engine's `loss_function`.

verl's `FSDPEngineWithLMHead` takes a TensorDict of *jagged* (padding-free) rows: `input_ids`
and `position_ids` one row per sample, and whatever else the loss reads. Its forward returns
`log_probs` as jagged rows of the same lengths where column t is log p(token t+1 | tokens ..t)
(the last column wraps around and is never used). So every field here is *target-aligned* like
`trainer.loss`: column t is about token t+1, the last column is 0.

    input_ids, position_ids   [B, (n_i)]  the sample's tokens, 0..n_i-1
    loss_mask                 [B, (n_i)]  1 where token t+1 was sampled (verl sums it for its token count)
    old_log_probs             [B, (n_i)]  behaviour logprob of token t+1, as the engine recorded it
    advantages, token_weight  [B, (n_i)]  the sample's advantage and loss weight on each position
    sample_temperature, sample_top_p, sample_top_k
                              [B, (n_i)]  how the sample's tokens were drawn (`trainer.logprobs.row_settings`)
    ref_log_probs             [B, (n_i)]  the reference policy's logprobs, when the loss has a KL term

`policy_loss_function` pads those rows back to [B, T] (T: the micro-batch's longest sample) and
computes exactly `trainer.loss.policy_loss` (PPO clip, dual clip, k3 KL, per-token weights): the
gradient is the same as the CPU backend's.
FSDP averages gradients over data-parallel ranks, so the loss is multiplied by their number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer.core import Sample
from trainer.core.tokens import Logprobs
from trainer.logprobs import TokenSampling, row_settings
from trainer.loss import LossMetrics, PolicyBatch, PolicyLossConfig, policy_loss

# A micro-batch a rank runs only to keep FSDP's collectives in step with the others: no loss, no gradient.
FILLER = Sample(
    rollout_id="filler",
    group_id=None,
    index=0,
    tokens=[0, 0],
    loss_mask=[0, 0],
    logprobs=[0.0, 0.0],
    call_ids=[],
    response_tokens=0,
)


def _jagged(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def _aligned(values: Logprobs, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token values shifted to target alignment: position t holds token t+1's value, the last 0."""
    row = torch.zeros(len(values), dtype=dtype)
    row[:-1] = torch.tensor(values[1:], dtype=dtype)
    return row


def _advantage_row(sample: Sample) -> torch.Tensor:
    """The sample's advantage on each position, target-aligned when it is per token (`token_advantages`)."""
    if sample.token_advantages is None:
        return torch.full((len(sample.tokens),), sample.advantage)
    return _aligned(sample.token_advantages)


def to_tensordict(
    samples: Sequence[Sample],
    *,
    temperature: float,
    ref_log_probs: Sequence[torch.Tensor] | None = None,
    entropy: bool = True,
) -> Any:
    """One micro-batch of samples as the engine's TensorDict (fields in the module docstring)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    fields: dict[str, Any] = {
        "input_ids": _jagged([torch.tensor(s.tokens, dtype=torch.long) for s in samples]),
        "position_ids": _jagged([torch.arange(len(s.tokens), dtype=torch.long) for s in samples]),
        "loss_mask": _jagged([_aligned([float(m) for m in s.loss_mask]) for s in samples]),
        "old_log_probs": _jagged([_aligned(s.logprobs) for s in samples]),
        "advantages": _jagged([_advantage_row(s) for s in samples]),
        "token_weight": _jagged([torch.full((len(s.tokens),), s.token_weight) for s in samples]),
    }
    settings = [row_settings(s.temperature, s.top_p, s.top_k, temperature) for s in samples]
    for name, column, dtype in (
        ("sample_temperature", 0, torch.float32),
        ("sample_top_p", 1, torch.float32),
        ("sample_top_k", 2, torch.long),
    ):
        rows = [
            torch.full((len(s.tokens),), row[column], dtype=dtype) for s, row in zip(samples, settings, strict=True)
        ]
        fields[name] = _jagged(rows)
    if ref_log_probs is not None:
        fields["ref_log_probs"] = _jagged(list(ref_log_probs))
    data = TensorDict(fields, batch_size=[len(samples)])
    tu.assign_non_tensor(
        data,
        temperature=1.0,  # verl's own scaling is unused: the head applies each sample's (`packed_request`)
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=len(samples),
        use_fused_kernels=False,
        calculate_entropy=entropy,
    )
    return data


def packed_request(data: Any) -> tuple[torch.Tensor, TokenSampling, torch.Tensor]:
    """What the log-prob head needs of a micro-batch, over its packed tokens [N]: the next token of each
    position (the next sample's first at a sample's end, never selected), how it was sampled, and which
    positions are computed (the loss mask's)."""
    ids = data["input_ids"].values()
    return (
        torch.roll(ids, -1),
        TokenSampling(
            temperature=data["sample_temperature"].values(),
            top_p=data["sample_top_p"].values(),
            top_k=data["sample_top_k"].values(),
        ),
        data["loss_mask"].values() > 0,
    )


def _padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Jagged rows as [B, width], zero-padded on the right.

    The width is explicit: a jagged tensor built from packed values and offsets (verl's
    `nested_tensor_from_jagged` for `log_probs` and `entropy`) carries no max length, and
    without one `to_padded_tensor` pads every row to the packed total of the micro-batch.
    """
    return torch.nested.to_padded_tensor(rows, 0.0, output_size=(rows.size(0), width))


def policy_loss_function(
    config: PolicyLossConfig, dp_size: int, sink: list[LossMetrics]
) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """The engine's `loss_function(model_output, data, dp_group)`: Rollwire's loss x `dp_size`; metrics go to `sink`."""

    def loss_function(
        model_output: dict[str, Any], data: Any, dp_group: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        width = int(data["input_ids"].offsets().diff().max())  # the longest sample: T
        logprobs = _padded(model_output["log_probs"], width).float()  # [B, T]
        field = {
            name: _padded(data[name], width).float()
            for name in ("loss_mask", "old_log_probs", "advantages", "token_weight")
        }
        ref = _padded(data["ref_log_probs"], width).float() if "ref_log_probs" in data.keys() else None
        batch = PolicyBatch(
            input_ids=torch.zeros(0, dtype=torch.long),  # not read by the loss
            attention_mask=torch.zeros(0, dtype=torch.long),
            loss_mask=field["loss_mask"],
            old_logprobs=field["old_log_probs"],
            advantages=field["advantages"],
            token_weight=field["token_weight"],
        )
        loss, metrics = policy_loss(logprobs, batch, config, ref_logprobs=ref)
        if "entropy" in model_output:
            entropy = _padded(model_output["entropy"], width).detach().float()
            mask = field["loss_mask"]
            value = float((entropy * mask).sum()) / metrics.tokens if metrics.tokens else 0.0
            metrics = LossMetrics(**{**{f: getattr(metrics, f) for f in metrics.__struct_fields__}, "entropy": value})
        sink.append(metrics)
        return loss * dp_size, {}

    return loss_function


def reference_rows(model_output: dict[str, Any]) -> list[torch.Tensor]:
    """The per-sample log-prob rows of an inference pass (the reference policy's), detached."""
    return [row.detach().float() for row in model_output["log_probs"].unbind()]
