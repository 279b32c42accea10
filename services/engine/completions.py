"""vLLM's token-in completions: `POST /v1/completions` with a prompt of token ids, answered in vLLM's shape.

The gateway's continuous prompt mode renders prompts itself (reusing the ids the model sampled) and
sends them here, so nothing is re-rendered or re-tokenized on the engine's side. The request and
response follow vLLM's `CompletionRequest` / `CompletionResponse` (vllm/entrypoints/openai/protocol.py):
`prompt` is a list of token ids (or a text, tokenized as is); `logprobs` is an integer (how many
alternatives per token); with `return_token_ids` every choice carries `prompt_token_ids` and
`token_ids`; a stream's first chunk carries each choice's `prompt_token_ids`. Logprobs come as
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`. Special tokens add no text (vLLM's
`skip_special_tokens`), but stay in `token_ids`. Sampling fields and their checks are the chat
endpoint's (`services.engine.protocol.sampling_params`). `echo` and `suffix` are refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from services.engine.engine import Engine, Started
from services.engine.output import ChoiceBuilder, LogprobEntry
from services.engine.protocol import (
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    RequestError,
    StreamOptions,
    Usage,
    decode_with,
)
from services.engine.responses import event_stream, sse, usage


class CompletionRequest(msgspec.Struct):
    """POST /v1/completions body (vLLM's fields that change the output; unknown fields are ignored)."""

    prompt: list[int] | str
    model: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    return_token_ids: bool | None = False
    echo: bool | None = False
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's legacy completions logprobs: one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    """One choice of a completion (whole, or one chunk's part of it)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class Completion(msgspec.Struct):
    """A completion response or stream chunk (vLLM's shape)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | UnsetType | None = UNSET
    weights_version: int | UnsetType = UNSET


_decoder = msgspec.json.Decoder(CompletionRequest)


def decode_completion_request(body: bytes, vocab_size: int) -> CompletionRequest:
    """Parse and check a completions body, or raise RequestError naming the bad field."""
    request: CompletionRequest = decode_with(_decoder, body)
    if request.echo or request.suffix:
        raise RequestError("echo and suffix are not supported by this engine", param="echo", code="unsupported_value")
    if isinstance(request.prompt, list):
        if not request.prompt:
            raise RequestError("prompt must hold at least one token id", param="prompt")
        if not all(0 <= t < vocab_size for t in request.prompt):
            raise RequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    top = request.logprobs or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    return request


def as_sampling_request(request: CompletionRequest) -> ChatCompletionRequest:
    """The chat request whose sampling fields are the completion's (one place checks and applies them)."""
    top = request.logprobs
    return ChatCompletionRequest(
        messages=[],
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        max_tokens=request.max_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        seed=request.seed,
        n=request.n,
        stream=request.stream,
        stream_options=request.stream_options,
        logprobs=top is not None,
        top_logprobs=top or None,
        ignore_eos=request.ignore_eos,
        response_format=request.response_format,
    )


def prompt_ids(engine: Engine, request: CompletionRequest) -> list[int]:
    """The prompt as token ids (a text prompt is tokenized without special tokens added)."""
    if isinstance(request.prompt, list):
        return request.prompt
    return list(engine.tokenizer.encode(request.prompt, add_special_tokens=False))


def _logprobs(entries: list[LogprobEntry], offset: int, want: bool) -> CompletionLogprobs | None:
    if not want:
        return None
    offsets, position = [], offset
    for entry in entries:
        offsets.append(position)
        position += len(entry.token)
    top = [{alt.token: alt.logprob for alt in entry.top_logprobs} for entry in entries]
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=top if any(top) else None,
        text_offset=offsets,
    )


def final_choice(builder: ChoiceBuilder, request: CompletionRequest, prompt: list[int]) -> CompletionChoice:
    """A finished choice of a non-streamed completion."""
    ids = bool(request.return_token_ids)
    return CompletionChoice(
        index=builder.index,
        text=builder.text,
        logprobs=_logprobs(builder.logprobs, 0, request.logprobs is not None),
        finish_reason=builder.finish_reason or "length",
        stop_reason=builder.stop_reason,
        prompt_token_ids=list(prompt) if ids else UNSET,
        token_ids=list(builder.token_ids) if ids else UNSET,
    )


def completion(engine: Engine, request: CompletionRequest, started: Started) -> Completion:
    """The whole answer of a non-streamed completion."""
    return Completion(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=engine.served_name,
        choices=[final_choice(b, request, started.prompt_ids) for b in started.builders],
        usage=usage(started.prompt_ids, started.builders),
        weights_version=started.weights_version,
    )


def stream(engine: Engine, request: CompletionRequest, started: Started) -> AsyncIterator[bytes]:
    """SSE chunks of a streamed completion: each choice's first chunk carries its prompt ids."""
    chunk_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    ids = bool(request.return_token_ids)
    offsets = {b.index: 0 for b in started.builders}
    opened: set[int] = set()

    def chunk(choices: list[CompletionChoice], counts: Usage | None = None, first: bool = False) -> bytes:
        return sse(
            Completion(
                id=chunk_id,
                created=created,
                model=engine.served_name,
                choices=choices,
                usage=UNSET if counts is None else counts,
                weights_version=started.weights_version if first else UNSET,
            )
        )

    async def chunks() -> AsyncIterator[bytes]:
        first = True
        async for deltas in started.job.deltas():
            choices = []
            for d in deltas:
                entries = [d.logprob] if d.logprob is not None else []
                choices.append(
                    CompletionChoice(
                        index=d.index,
                        text=d.content,
                        logprobs=_logprobs(entries, offsets[d.index], request.logprobs is not None),
                        finish_reason=d.finish_reason,
                        stop_reason=d.stop_reason,
                        prompt_token_ids=started.prompt_ids if ids and d.index not in opened else UNSET,
                        token_ids=[d.token_id] if ids else UNSET,
                    )
                )
                offsets[d.index] += len(d.content)
                opened.add(d.index)
            yield chunk(choices, first=first)
            first = False

    return event_stream(
        started, chunks(), request.stream_options, lambda: chunk([], counts=usage(started.prompt_ids, started.builders))
    )
