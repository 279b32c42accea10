"""The token loop: prefill once, then one forward pass per generated token over a KV cache.

`generate` is a generator so the scheduler can interleave requests token by token. A request's n
choices share the prompt: the prompt is run once, its KV cache is repeated n times, and the choices
advance as one batch; a finished choice is dropped from the batch (and the cache) at once. Each
choice samples from its own `torch.Generator`, so a seeded choice is reproducible whatever else runs.
Must be driven under `torch.inference_mode()` (the scheduler thread does that).
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from typing import Any

import torch

from services.engine.output import ChoiceBuilder, TokenDelta
from services.engine.sampling import SamplingParams, raw_logprobs, sample_token, top_entries


def cache_argument(model: torch.nn.Module) -> str:
    """The name `model.forward` takes the KV cache under (`cache` in recent transformers, else `past_key_values`)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def generate(
    model: torch.nn.Module,
    cache_arg: str,
    prompt_ids: list[int],
    params: SamplingParams,
    generators: list[torch.Generator],
    builders: list[ChoiceBuilder],
) -> Generator[list[TokenDelta], None, None]:
    """Yield, after each step, one delta per choice still running (prefill counts as the first step)."""
    output = model(input_ids=torch.tensor([prompt_ids], dtype=torch.long), use_cache=True, logits_to_keep=1)
    cache = _cache_of(output)
    logits = output.logits[:, -1, :].float()  # [1, V]
    rows = list(range(len(builders)))  # batch row -> choice index
    if len(rows) > 1:
        cache.batch_repeat_interleave(len(rows))
        logits = logits.expand(len(rows), -1)  # [n, V]
    while True:
        deltas: list[TokenDelta] = []
        sampled: list[int] = []
        for row, choice in enumerate(rows):
            row_logits = logits[row]
            token = sample_token(row_logits, params, generators[choice])
            logprobs = raw_logprobs(row_logits)
            top = top_entries(logprobs, params.top_logprobs)
            deltas.append(builders[choice].add(token, float(logprobs[token]), top))
            sampled.append(token)
        yield deltas
        keep = [row for row, choice in enumerate(rows) if not builders[choice].finished]
        if not keep:
            return
        if len(keep) < len(rows):
            cache.batch_select_indices(torch.tensor(keep, dtype=torch.long))
            rows = [rows[row] for row in keep]
            sampled = [sampled[row] for row in keep]
        step_input = torch.tensor(sampled, dtype=torch.long)[:, None]  # [rows, 1]
        output = model(input_ids=step_input, use_cache=True, **{cache_arg: cache})
        cache = _cache_of(output)
        logits = output.logits[:, -1, :].float()
