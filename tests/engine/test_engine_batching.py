"""Continuous batching: a request computes the same tokens and logprobs in a shared batch as alone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from services.common.tinymodel.tokenizer import TokenTable
from services.engine.generation import Batch, Generation
from services.engine.output import ChoiceBuilder
from services.engine.sampling import SamplingParams, choice_seed
from services.engine.scheduler import limit_torch_threads_here
from services.engine.weights import Weights, load_weights

T = TypeVar("T")


def _on_one_torch_thread(work: Callable[[], T]) -> T:
    """Run `work` in a thread using one torch thread, as the engine's generation thread does."""
    result: list[T] = []

    def run() -> None:
        limit_torch_threads_here(1)
        with torch.inference_mode():
            result.append(work())

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert result, "the work raised (see the thread's traceback above)"
    return result[0]


@pytest.fixture(scope="module")
def weights(tiny_model_dir: Path) -> Weights:
    """The tiny model loaded for serving."""
    loaded = load_weights(tiny_model_dir, 0)
    assert loaded.batchable
    return loaded


@pytest.fixture(scope="module")
def table(tiny_tokenizer: PreTrainedTokenizerFast, weights: Weights) -> TokenTable:
    """Bytes of every tiny-model token."""
    return TokenTable.build(tiny_tokenizer, weights.vocab_size)


def _generation(table: TokenTable, prompt_len: int, params: SamplingParams, seed: int, n: int = 1) -> Generation:
    prompt = [(7 * i + prompt_len) % 2000 + 3 for i in range(prompt_len)]
    builders = [ChoiceBuilder(i, table, params, frozenset(), False, True) for i in range(n)]
    generators = [torch.Generator().manual_seed(choice_seed(seed, i)) for i in range(n)]
    return Generation(prompt, params, builders, generators)


def _outputs(generation: Generation) -> list[tuple[list[int], torch.Tensor]]:
    return [(b.token_ids, torch.tensor([e.logprob for e in b.logprobs])) for b in generation.builders]


def _alone(weights: Weights, generation: Generation) -> list[tuple[list[int], torch.Tensor]]:
    batch = Batch(weights)
    batch.admit("alone", generation)
    while batch.rows:
        batch.step()
    return _outputs(generation)


def test_rows_joining_and_leaving_a_batch_match_running_alone(weights: Weights, table: TokenTable) -> None:
    greedy = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 8, 20, 25)]
    sampled = SamplingParams(max_tokens=18, temperature=1.0, top_p=0.95, ignore_eos=True)
    plan = [  # (prompt length, params, seed, n, steps to run before the next request joins)
        (5, greedy[0], 1, 1, 0),
        (40, greedy[1], 2, 1, 3),
        (17, sampled, 3, 2, 5),
        (60, greedy[2], 4, 1, 2),
        (9, greedy[3], 5, 1, 0),
    ]

    def together() -> list[Generation]:
        batch = Batch(weights)
        generations = []
        for index, (length, params, seed, n, steps) in enumerate(plan):
            generations.append(_generation(table, length, params, seed, n))
            batch.admit(index, generations[-1])
            for _ in range(steps):
                batch.step()
        while batch.rows:
            batch.step()
        return generations

    generations = _on_one_torch_thread(together)
    for (length, params, seed, n, _), generation in zip(plan, generations, strict=True):
        expected = _on_one_torch_thread(partial(_alone, weights, _generation(table, length, params, seed, n)))
        for (tokens, logprobs), (alone_tokens, alone_logprobs) in zip(_outputs(generation), expected, strict=True):
            assert tokens == alone_tokens
            assert len(tokens) == params.max_tokens
            assert torch.allclose(logprobs, alone_logprobs, atol=1e-4), (logprobs - alone_logprobs).abs().max()


def test_dropping_a_request_leaves_the_others_intact(weights: Weights, table: TokenTable) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    keep, drop = _generation(table, 30, params, 1), _generation(table, 11, params, 2)

    def run() -> list[int]:
        batch = Batch(weights)
        batch.admit("keep", keep)
        batch.admit("drop", drop)
        batch.step()
        batch.drop("drop")
        assert batch.owners() == ["keep"]
        pads = [row.pad for row in batch.rows]
        while batch.rows:
            batch.step()
        return pads

    assert _on_one_torch_thread(run) == [0]  # padding nobody needs any more is trimmed
    alone = _on_one_torch_thread(partial(_alone, weights, _generation(table, 30, params, 1)))
    assert _outputs(keep)[0][0] == alone[0][0]
    assert len(drop.builders[0].token_ids) == 2 and not drop.builders[0].finished
