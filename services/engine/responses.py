"""Building vLLM-shaped response bodies from finished choices and per-token deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
from msgspec import UNSET

from services.engine.engine import Started
from services.engine.output import ChoiceBuilder, TokenDelta
from services.engine.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FunctionDelta,
    RequestError,
    StreamOptions,
    ToolCallDelta,
    Usage,
)
from services.engine.scheduler import EngineClosedError, GenerationFailedError

_encoder = msgspec.json.Encoder()


def encode(payload: Any) -> bytes:
    """JSON bytes of a response Struct (or plain data)."""
    return _encoder.encode(payload)


def sse(payload: Any) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def usage(prompt_ids: Sequence[int], builders: Sequence[ChoiceBuilder]) -> Usage:
    """Token counts of a request: completion tokens summed over its choices."""
    completion = sum(len(b.token_ids) for b in builders)
    return Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion, total_tokens=len(prompt_ids) + completion)


def final_choice(builder: ChoiceBuilder, request: ChatCompletionRequest) -> Choice:
    """A finished choice of a non-streaming response."""
    calls = list(builder.tool_calls)
    return Choice(
        index=builder.index,
        message=AssistantMessage(content=builder.content, tool_calls=calls if calls else UNSET),
        logprobs=ChoiceLogprobs(content=builder.logprobs) if request.logprobs else None,
        finish_reason=builder.finish_reason or "length",
        stop_reason=builder.stop_reason,
        token_ids=list(builder.token_ids) if request.return_token_ids else UNSET,
    )


def chunk_choice(delta: TokenDelta, request: ChatCompletionRequest) -> ChunkChoice:
    """One token's part of a stream chunk (tool calls arrive whole in the finishing chunk)."""
    calls = [
        ToolCallDelta(index=i, id=call.id, function=FunctionDelta(call.function.name, call.function.arguments))
        for i, call in enumerate(delta.tool_calls)
    ]
    return ChunkChoice(
        index=delta.index,
        delta=Delta(content=delta.content if delta.content else UNSET, tool_calls=calls if calls else UNSET),
        logprobs=ChoiceLogprobs(content=[delta.logprob]) if delta.logprob is not None else None,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason if delta.finish_reason else UNSET,
        token_ids=[delta.token_id] if request.return_token_ids else UNSET,
    )


def generation_error(exc: Exception) -> RequestError:
    """The error a failed generation is answered with (500, `generation_failed`)."""
    return RequestError(str(exc), code="generation_failed", status=500, error_type="server_error")


async def event_stream(
    started: Started, chunks: AsyncIterator[bytes], options: StreamOptions | None, usage_chunk: Callable[[], bytes]
) -> AsyncIterator[bytes]:
    """A streamed answer's body: its chunks, an error event if generation fails, else the usage chunk
    when `options` ask for it, then `[DONE]`; the job is cancelled however the stream ends (a client
    gone stops it)."""
    try:
        try:
            async for piece in chunks:
                yield piece
        except (GenerationFailedError, EngineClosedError) as exc:
            yield sse(generation_error(exc).body())
        else:
            if options is not None and options.include_usage:
                yield usage_chunk()
        yield b"data: [DONE]\n\n"
    finally:
        started.job.cancel()
