"""The generation thread: failures reach the request, the thread survives them, shutdown ends requests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from services.common.tinymodel.tokenizer import TokenTable
from services.engine.generation import Generation
from services.engine.output import ChoiceBuilder
from services.engine.sampling import SamplingParams
from services.engine.scheduler import EngineClosedError, GenerationFailedError, Job, Scheduler
from services.engine.weights import Weights, load_weights


class Exploding(torch.nn.Module):
    """A model whose forward pass fails, like one that runs out of memory."""

    def forward(self, **_: Any) -> Any:
        raise RuntimeError("boom")


def _job(table: TokenTable, weights: Weights, max_tokens: int) -> Job:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    builders = [ChoiceBuilder(0, table, params, frozenset(), False, False)]
    generation = Generation([1, 50, 60, 2], params, builders, [torch.Generator().manual_seed(0)])
    return Job(generation, weights, asyncio.get_running_loop())


async def _drain(job: Job) -> int:
    steps = 0
    async for _ in job.deltas():
        steps += 1
    return steps


async def test_a_failing_forward_fails_its_request_and_not_the_engine(
    tiny_model_dir: Path, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    good = load_weights(tiny_model_dir, 0)
    bad = Weights(cast(PreTrainedModel, Exploding()), 0, tiny_model_dir, "cache", batchable=False)
    table = TokenTable.build(tiny_tokenizer, good.vocab_size)
    scheduler = Scheduler(threads=1)
    try:
        failing = _job(table, bad, 5)
        scheduler.submit(failing)
        with pytest.raises(GenerationFailedError, match="boom"):
            await _drain(failing)
        healthy = _job(table, good, 5)
        scheduler.submit(healthy)
        assert await _drain(healthy) == 5
        assert scheduler.running == 0
    finally:
        await asyncio.to_thread(scheduler.close)


async def test_shutdown_ends_running_requests_with_a_named_error(
    tiny_model_dir: Path, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    weights = load_weights(tiny_model_dir, 0)
    table = TokenTable.build(tiny_tokenizer, weights.vocab_size)
    scheduler = Scheduler(threads=1)
    job = _job(table, weights, 100_000)
    scheduler.submit(job)
    deltas = job.deltas()
    await anext(deltas)  # generation is under way
    await asyncio.to_thread(scheduler.close)
    with pytest.raises(EngineClosedError):
        async for _ in deltas:
            pass
    with pytest.raises(EngineClosedError):
        scheduler.submit(_job(table, weights, 1))
