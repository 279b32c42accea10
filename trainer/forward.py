"""One forward pass over a batch whose rows share a prefix, with the prefix computed once.

Agent rollouts of one run usually open with the same system turn (instructions, tool
descriptions): often most of a short sample's tokens. `forward_logits` runs that shared prefix
once with batch size 1, repeats its KV cache over the batch and runs only the rest of each row;
the logits are the same as those of running every full row (tested, gradients included), at a
fraction of the cost. Rows are right-padded, so every row's real tokens start at position 0 and
the suffix positions follow the cache.
"""

from __future__ import annotations

import inspect

import torch

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
