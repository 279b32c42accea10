"""The token loop with continuous batching: running choices share one left-padded KV cache.

Every running choice (a row) on the same weights advances in the same forward pass, one token per
step. A new request is prefilled alone (its prompt runs once whatever n is), sampled for its first
token, and its cache, repeated for its n choices, is merged into the running batch by left-padding
the shorter of the two caches. The attention mask hides each row's padding and explicit position
ids keep each row's positions its own, so a row computes what it would compute alone, up to float
rounding from the batch shape (as in vLLM, concurrent traffic can change the last bits). A
finished or cancelled row leaves the batch at once; padding no row needs any more is trimmed.

Each choice samples from its own `torch.Generator`. Must be driven from one thread under
`torch.inference_mode()` (the scheduler).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from services.engine.output import ChoiceBuilder, TokenDelta
from services.engine.sampling import SamplingParams, sample_token, sampled_logprobs, top_entries
from services.engine.weights import Weights


@dataclass
class Generation:
    """What one request asks the token loop for: a prompt and its choices."""

    prompt_ids: list[int]
    params: SamplingParams
    builders: list[ChoiceBuilder]
    generators: list[torch.Generator]


@dataclass
class Row:
    """One running choice in a batch."""

    owner: Any  # the scheduler's job this choice belongs to
    builder: ChoiceBuilder
    generator: torch.Generator
    params: SamplingParams
    length: int  # real tokens in the cache (the next token's position)
    token: int  # last sampled token, fed at the next step
    pad: int = 0  # left padding columns in the batch cache


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _choose(
    row_logits: torch.Tensor, builder: ChoiceBuilder, params: SamplingParams, gen: torch.Generator
) -> TokenDelta:
    """Sample a token from logits [V] and record it with its logprob under the distribution sampled from."""
    token = sample_token(row_logits, params, gen)
    logprobs = sampled_logprobs(row_logits, params)
    return builder.add(token, float(logprobs[token]), top_entries(logprobs, params.top_logprobs))


def _left_pad(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H, columns + L, D], zeros in front."""
    return F.pad(tensor, (0, 0, columns, 0)) if columns else tensor


@dataclass
class Batch:
    """Rows decoding together on one set of weights (see the module docstring)."""

    weights: Weights
    rows: list[Row] = field(default_factory=list)
    _cache: Any = None

    def _width(self) -> int:
        return int(self._cache.get_seq_length()) if self._cache is not None else 0

    def _layers(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def admit(self, owner: Any, generation: Generation) -> list[TokenDelta]:
        """Prefill a request, sample its first tokens, and merge its unfinished choices into the batch."""
        model = self.weights.model
        prompt = torch.tensor([generation.prompt_ids], dtype=torch.long)
        output = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        logits = output.logits[0, -1, :].float()  # [V]
        deltas: list[TokenDelta] = []
        joining: list[Row] = []
        for builder, gen in zip(generation.builders, generation.generators, strict=True):
            delta = _choose(logits, builder, generation.params, gen)
            deltas.append(delta)
            if not builder.finished:
                length = len(generation.prompt_ids)
                joining.append(Row(owner, builder, gen, generation.params, length, delta.token_id))
        if joining:
            self._merge(_cache_of(output), joining)
        return deltas

    def _merge(self, cache: Any, joining: list[Row]) -> None:
        if len(joining) > 1:
            cache.batch_repeat_interleave(len(joining))
        if self._cache is None:
            self._cache, self.rows = cache, joining
            return
        width, incoming = self._width(), int(cache.get_seq_length())
        merged_width = max(width, incoming)
        layers = [
            (
                torch.cat([_left_pad(k, merged_width - width), _left_pad(k_new, merged_width - incoming)]),
                torch.cat([_left_pad(v, merged_width - width), _left_pad(v_new, merged_width - incoming)]),
            )
            for (k, v), (k_new, v_new) in zip(self._layers(self._cache), self._layers(cache), strict=True)
        ]
        for row in self.rows:
            row.pad += merged_width - width
        for row in joining:
            row.pad = merged_width - incoming
        self._cache = DynamicCache(layers)
        self.rows = self.rows + joining

    def step(self) -> list[tuple[Any, TokenDelta]]:
        """One forward pass for every row; returns (owner, delta) per row, finished rows leave."""
        rows = self.rows
        width = self._width()
        input_ids = torch.tensor([[row.token] for row in rows], dtype=torch.long)  # [B, 1]
        positions = torch.tensor([[row.length] for row in rows], dtype=torch.long)  # [B, 1]
        mask = None
        if any(row.pad for row in rows):
            mask = torch.ones(len(rows), width + 1, dtype=torch.long)  # [B, width + 1]
            for i, row in enumerate(rows):
                mask[i, : row.pad] = 0
        output = self.weights.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.weights.cache_arg: self._cache},
        )
        self._cache = _cache_of(output)
        logits = output.logits[:, -1, :].float()  # [B, V]
        results = []
        for i, row in enumerate(rows):
            row.length += 1
            delta = _choose(logits[i], row.builder, row.params, row.generator)
            row.token = delta.token_id
            results.append((row.owner, delta))
        self._remove(lambda row: row.builder.finished)
        return results

    def drop(self, owner: Any) -> None:
        """Remove every row of `owner` (a cancelled request)."""
        self._remove(lambda row: row.owner is owner)

    def owners(self) -> list[Any]:
        """The requests with rows in this batch, in admission order."""
        return list(dict.fromkeys(row.owner for row in self.rows))

    def _remove(self, leaving: Callable[[Row], bool]) -> None:
        keep = [i for i, row in enumerate(self.rows) if not leaving(row)]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self._cache = [], None
            return
        self._cache.batch_select_indices(torch.tensor(keep, dtype=torch.long))
        self.rows = [self.rows[i] for i in keep]
        self._trim()

    def _trim(self) -> None:
        unused = min(row.pad for row in self.rows)
        if not unused:
            return
        self._cache = DynamicCache([(k[:, :, unused:], v[:, :, unused:]) for k, v in self._layers(self._cache)])
        for row in self.rows:
            row.pad -= unused
