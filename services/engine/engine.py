"""The engine's state: tokenizer, current weights (swappable), and the generation scheduler.

`Engine.start` renders a request's prompt, pins the weights current at that moment, and submits
the token loop to the scheduler. `Engine.reload` loads a saved model directory into a new model
object and swaps it in: requests already running keep the weights they started with (their job
holds a reference), requests accepted afterwards use the new ones. The tokenizer never changes.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import torch

from services.common.tinymodel.tokenizer import ModelLoadError, TokenTable, load_tokenizer
from services.engine.generation import Generation
from services.engine.output import ChoiceBuilder
from services.engine.protocol import (
    ChatCompletionRequest,
    RequestError,
    parses_tools,
    sampling_params,
    template_messages,
    template_tools,
)
from services.engine.sampling import SamplingParams, choice_seed
from services.engine.scheduler import Job, Scheduler
from services.engine.weights import Weights, load_weights

SMALL_MODEL_PARAMETERS = 100_000_000


def _auto_threads(weights: Weights) -> int | None:
    """One torch thread for small models (their steps are too short to split), else torch's default."""
    parameters = sum(p.numel() for p in weights.model.parameters())
    return 1 if parameters < SMALL_MODEL_PARAMETERS else None


def _eos_ids(weights: Weights, eos_token_id: int | None) -> frozenset[int]:
    configured = weights.model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    if eos_token_id is not None:
        ids.add(eos_token_id)
    return frozenset(ids)


@dataclass(frozen=True)
class Started:
    """A request handed to the scheduler: its job, choice builders and the weights it runs on."""

    job: Job
    builders: list[ChoiceBuilder]
    weights_version: int
    prompt_ids: list[int]


class Engine:
    """Serves one model (see the module docstring)."""

    def __init__(
        self,
        model_dir: Path,
        served_name: str | None = None,
        seed: int | None = None,
        weights_version: int = 0,
        max_model_len: int | None = None,
        threads: int | None = None,
    ) -> None:
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        if not self.tokenizer.chat_template:
            raise ModelLoadError(f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
        self.weights = load_weights(model_dir, weights_version)
        self.table = TokenTable.build(self.tokenizer, self.weights.vocab_size)
        self.eos_token_ids = _eos_ids(self.weights, self.tokenizer.eos_token_id)
        limit = int(getattr(self.weights.model.config, "max_position_embeddings", 0) or 0) or None
        self.max_model_len = min(x for x in (max_model_len, limit, 1 << 31) if x)
        self.served_name = served_name or model_dir.resolve().name
        self.created = int(model_dir.stat().st_mtime)
        self._seeds: random.Random = random.Random(seed) if seed is not None else random.SystemRandom()
        self.scheduler = Scheduler(threads if threads is not None else _auto_threads(self.weights))
        self._reload_lock: asyncio.Lock | None = None

    def prompt_ids(self, request: ChatCompletionRequest) -> list[int]:
        """The request's conversation rendered by the chat template and tokenized."""
        kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
        try:
            text = self.tokenizer.apply_chat_template(
                template_messages(request),
                tools=template_tools(request),  # type: ignore[arg-type]
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise RequestError(f"the chat template could not render these messages: {exc}", param="messages") from None
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def tokenizer_files(self) -> dict[str, Any]:
        """tokenizer.json, tokenizer_config.json and the chat template, for a gateway rendering prompts itself."""
        config_file = self.model_dir / "tokenizer_config.json"
        return {
            "tokenizer_json": (self.model_dir / "tokenizer.json").read_text(encoding="utf-8"),
            "tokenizer_config": json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {},
            "chat_template": self.tokenizer.chat_template,
            "eos_token_ids": sorted(self.eos_token_ids),
        }

    def start(self, request: ChatCompletionRequest, prompt_ids: list[int] | None = None) -> Started:
        """Validate, render and submit a request; generation starts at once on the current weights.

        `prompt_ids` given (a token-in completion): the prompt as is, nothing rendered, no tool parsing.
        """
        parse_tools = prompt_ids is None and parses_tools(request)
        if prompt_ids is None:
            prompt_ids = self.prompt_ids(request)
        weights = self.weights
        params: SamplingParams = sampling_params(request, len(prompt_ids), self.max_model_len, weights.vocab_size)
        n = request.n or 1
        seed = request.seed if request.seed is not None else self._seeds.getrandbits(63)
        generators = [torch.Generator().manual_seed(choice_seed(seed, i)) for i in range(n)]
        builders = [
            ChoiceBuilder(i, self.table, params, self.eos_token_ids, parse_tools, bool(request.logprobs))
            for i in range(n)
        ]
        generation = Generation(prompt_ids, params, builders, generators)
        job = Job(generation, weights, asyncio.get_running_loop(), report_steps=bool(request.stream))
        self.scheduler.submit(job)
        return Started(job=job, builders=builders, weights_version=weights.version, prompt_ids=prompt_ids)

    async def reload(self, path: Path, version: int) -> Weights:
        """Load new weights from `path` and serve them from the next request on."""
        if self._reload_lock is None:
            self._reload_lock = asyncio.Lock()
        async with self._reload_lock:
            weights = await asyncio.to_thread(load_weights, path, version)
            if weights.vocab_size != self.weights.vocab_size:
                raise ModelLoadError(
                    f"{path} has vocab_size {weights.vocab_size}, the served model {self.weights.vocab_size}; "
                    "reload only weights of the same model (the tokenizer cannot change)"
                )
            self.weights = weights
            return weights

    def close(self) -> None:
        """Stop the generation thread."""
        self.scheduler.close()
