"""The policy's token logprobs of a batch (`policy_logprobs`), and a forward pass whose rows share a prefix.

`policy_logprobs` runs the model to its last hidden states (no logits), then the chunked
`trainer.logprobs.selected_logprobs` on the sampled positions only: the path every backend takes
(verl's runs the same function inside the output projection, `trainer.verl_engine`).

Agent rollouts of one run usually open with the same system turn (instructions, tool
descriptions): often most of a short sample's tokens. `forward_logits` runs that shared prefix
once with batch size 1, repeats its KV cache over the batch and runs only the rest of each row;
the logits are the same as those of running every full row (tested, gradients included), at a
fraction of the cost. Rows are right-padded, so every row's real tokens start at position 0 and
the suffix positions follow the cache.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from trainer.logprobs import CHUNK_TOKENS, TokenSampling, returning_hidden, selected_logprobs

MIN_SHARED_PREFIX = 16  # below this the second forward call costs more than it saves


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Leading positions on which every row has the same real token, leaving each row one more token.

    input_ids, attention_mask: [B, T] (right padding).
    """
    lengths = attention_mask.sum(dim=1)  # [B]
    limit = int(lengths.min()) - 1
    if input_ids.shape[0] < 2 or limit < 1:
        return 0
    same = (input_ids[:, :limit] == input_ids[:1, :limit]).all(dim=0)  # [limit]
    differs = (~same).nonzero()
    return int(differs[0]) if len(differs) else limit


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The name `model.forward` takes a KV cache under (`cache` in recent transformers)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, share_prefix: bool = True
) -> torch.Tensor:
    """Logits [B, T, V] of a causal LM on right-padded rows, running a shared prefix only once."""
    prefix = shared_prefix_length(input_ids, attention_mask) if share_prefix else 0
    if prefix < MIN_SHARED_PREFIX:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits
    rows = input_ids.shape[0]
    head = model(input_ids=input_ids[:1, :prefix], use_cache=True)
    cache = getattr(head, "cache", None) or head.past_key_values
    cache.batch_repeat_interleave(rows)
    tail = model(
        input_ids=input_ids[:, prefix:],  # [B, T-P]
        attention_mask=attention_mask,  # [B, T]: the cached prefix, then the rest
        **{_cache_kwarg(model): cache},
    ).logits  # [B, T-P, V]
    return torch.cat([head.logits.expand(rows, -1, -1), tail], dim=1)  # [B, T, V]


def policy_logprobs(
    model: Any, batch: Any, *, share_prefix: bool = True, chunk_tokens: int = CHUNK_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropies [B, T'] of a `trainer.loss.PolicyBatch`'s targets at its loss-mask positions.

    Padded layout: one forward over the rows (a shared prefix run once); packed: one row with
    positions restarting per sample and no attention mask (transformers then keeps attention
    within each sample: flash-attn varlen or a block-diagonal sdpa mask). Each target under its
    own temperature, top_p and top_k (`batch.sampling`).
    """
    targets: torch.Tensor = batch.targets
    sampling: TokenSampling = batch.sampling
    with returning_hidden(model) as head:
        if batch.position_ids is not None:
            hidden = model(
                input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
            ).logits  # [1, N, H]
        else:
            hidden = forward_logits(model, batch.input_ids, batch.attention_mask, share_prefix=share_prefix)
    width = targets.shape[1]
    flat = hidden[:, :width].reshape(-1, hidden.shape[-1])  # [B*T', H]
    select = batch.loss_mask.reshape(-1) > 0
    logprobs, entropy = selected_logprobs(flat, head, targets.reshape(-1), sampling, select, chunk_tokens=chunk_tokens)
    return logprobs.view_as(batch.loss_mask), entropy.view_as(batch.loss_mask)
