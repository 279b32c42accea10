"""HTTP front of the embedded engine: OpenAI chat completions answered in vLLM's format.

Routes:
    POST /v1/chat/completions  non-streaming or SSE (`stream: true`); vLLM extras `return_token_ids`,
                               `top_k`, `stop_token_ids`, `ignore_eos`, `chat_template_kwargs`
    GET  /v1/models            the served model, with `weights_version` and `max_model_len`
    GET  /health               {"status": "ok", "weights_version", "running"}
    POST /reload               {"path": DIR, "weights_version": int}: serve new weights from now on

Every response carries the header `x-rollwire-weights-version` (for completions: the version the
request ran on; the body says it too, in a stream in the first chunk). Client errors are answered
with OpenAI's error body and status 400 (404 for an unknown model or route), never 500.
A stream's first chunk carries the role and `prompt_token_ids`; then one chunk per generation step
with the new text, `token_ids` and logprobs of each running choice; a usage chunk when
`stream_options.include_usage`; then `data: [DONE]`. If the client disconnects, generation stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from msgspec import UNSET
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.engine.engine import Engine, Started
from services.engine.output import ChoiceBuilder, TokenDelta
from services.engine.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FunctionDelta,
    ModelCard,
    ModelList,
    RequestError,
    ToolCallDelta,
    Usage,
    decode_chat_request,
    decode_reload_request,
)
from services.engine.scheduler import EngineClosedError, GenerationFailedError
from services.engine.tokenizer import ModelLoadError

WEIGHTS_VERSION_HEADER = "x-rollwire-weights-version"
_encoder = msgspec.json.Encoder()


def _json(payload: Any, version: int, status: int = 200) -> Response:
    headers = {WEIGHTS_VERSION_HEADER: str(version)}
    return Response(_encoder.encode(payload), status_code=status, media_type="application/json", headers=headers)


def _sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def _usage(started: Started) -> Usage:
    completion = sum(len(b.token_ids) for b in started.builders)
    prompt = len(started.prompt_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _final_choice(builder: ChoiceBuilder, request: ChatCompletionRequest) -> Choice:
    calls = list(builder.tool_calls)
    return Choice(
        index=builder.index,
        message=AssistantMessage(content=builder.content, tool_calls=calls if calls else UNSET),
        logprobs=ChoiceLogprobs(content=builder.logprobs) if request.logprobs else None,
        finish_reason=builder.finish_reason or "length",
        stop_reason=builder.stop_reason,
        token_ids=list(builder.token_ids) if request.return_token_ids else UNSET,
    )


def _chunk_choice(delta: TokenDelta, request: ChatCompletionRequest) -> ChunkChoice:
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


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(started: Started, request: Request) -> bool:
    """Run a non-streaming request to the end; False if the client went away first (generation stopped)."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        async for _ in started.job.deltas():
            if watcher.done():
                return False
        return True
    finally:
        watcher.cancel()
        started.job.cancel()


async def _stream(engine: Engine, request: ChatCompletionRequest, started: Started) -> AsyncIterator[bytes]:
    chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None, first: bool = False) -> bytes:
        return _sse(
            ChatCompletionChunk(
                id=chunk_id,
                created=created,
                model=engine.served_name,
                choices=choices,
                usage=UNSET if usage is None else usage,
                prompt_token_ids=started.prompt_ids if first and request.return_token_ids else UNSET,
                weights_version=started.weights_version if first else UNSET,
            )
        )

    try:
        roles = [ChunkChoice(index=b.index, delta=Delta(role="assistant", content="")) for b in started.builders]
        yield chunk(roles, first=True)
        try:
            async for deltas in started.job.deltas():
                yield chunk([_chunk_choice(d, request) for d in deltas])
        except (GenerationFailedError, EngineClosedError) as exc:
            error = RequestError(str(exc), code="generation_failed", status=500, error_type="server_error")
            yield _sse(error.body())
        else:
            if request.stream_options is not None and request.stream_options.include_usage:
                yield chunk([], usage=_usage(started))
        yield b"data: [DONE]\n\n"
    finally:
        started.job.cancel()


def _routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/health")
    async def health() -> Response:
        payload = {"status": "ok", "weights_version": engine.weights.version, "running": engine.scheduler.running}
        return _json(payload, engine.weights.version)

    @app.get("/v1/models")
    async def models() -> Response:
        weights = engine.weights
        card = ModelCard(
            id=engine.served_name,
            created=engine.created,
            root=str(weights.path),
            max_model_len=engine.max_model_len,
            weights_version=weights.version,
        )
        return _json(ModelList(data=[card]), weights.version)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request) -> Response:
        request = decode_chat_request(await http_request.body())
        if request.model is not None and request.model != engine.served_name:
            raise RequestError(
                f"the model `{request.model}` does not exist; this engine serves `{engine.served_name}`",
                param="model",
                code="model_not_found",
                status=404,
            )
        started = engine.start(request)
        if request.stream:
            return StreamingResponse(
                _stream(engine, request, started),
                media_type="text/event-stream",
                headers={WEIGHTS_VERSION_HEADER: str(started.weights_version), "cache-control": "no-cache"},
            )
        try:
            completed = await _collect(started, http_request)
        except (GenerationFailedError, EngineClosedError) as exc:
            error = RequestError(str(exc), code="generation_failed", status=500, error_type="server_error")
            return _json(error.body(), started.weights_version, status=500)
        if not completed:
            return Response(status_code=499)
        response = ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=engine.served_name,
            choices=[_final_choice(b, request) for b in started.builders],
            usage=_usage(started),
            weights_version=started.weights_version,
            prompt_token_ids=started.prompt_ids if request.return_token_ids else UNSET,
        )
        return _json(response, started.weights_version)

    @app.post("/reload")
    async def reload(http_request: Request) -> Response:
        request = decode_reload_request(await http_request.body())
        try:
            weights = await engine.reload(Path(request.path), request.weights_version)
        except ModelLoadError as exc:
            raise RequestError(str(exc), param="path", code="invalid_model") from None
        payload = {"model": engine.served_name, "path": str(weights.path), "weights_version": weights.version}
        return _json(payload, weights.version)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = RequestError(str(exc.detail), code="not_found" if exc.status_code == 404 else "http_error").body()
        return JSONResponse(body, status_code=exc.status_code)


def create_app(
    model_dir: Path | None = None,
    *,
    engine: Engine | None = None,
    served_name: str | None = None,
    seed: int | None = None,
    weights_version: int = 0,
    max_model_len: int | None = None,
) -> FastAPI:
    """The engine's ASGI app over `model_dir` (or an existing `engine`, which the caller then owns)."""
    owned = engine is None
    if engine is None:
        if model_dir is None:
            raise ValueError("create_app needs model_dir or engine")
        engine = Engine(model_dir, served_name, seed, weights_version, max_model_len)
    served = engine

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owned:
                with contextlib.suppress(Exception):
                    served.close()

    app = FastAPI(title="Rollwire embedded engine", lifespan=lifespan)
    app.state.engine = served
    _routes(app, served)
    _error_handlers(app)
    return app
