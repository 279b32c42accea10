"""HTTP front of the embedded engine: OpenAI chat completions answered in vLLM's format.

Routes:
    POST /v1/chat/completions  non-streaming or SSE (`stream: true`); vLLM extras `return_token_ids`,
                               `top_k`, `stop_token_ids`, `ignore_eos`, `chat_template_kwargs`
    GET  /v1/models            the served model, with `weights_version` and `max_model_len`
    GET  /health               {"status": "ok", "weights_version", "running"}
    POST /v1/completions       token-in completions (`prompt` as token ids), vLLM's shape; streamed or not
    GET  /v1/tokenizer         tokenizer.json, tokenizer_config.json, chat template and EOS ids of the model
    POST /reload               {"path": DIR, "weights_version": int}: serve new weights from now on

Every response carries the header `x-rollwire-weights-version` (for completions: the version the
request ran on; the body says it too, in a stream in the first chunk). Client errors are answered
with OpenAI's error body and status 400 (404 for an unknown model or route), never 500.
A stream's first chunk carries the role and `prompt_token_ids`; then one chunk per generation step
with the new text, `token_ids` and logprobs of each running choice; a usage chunk when
`stream_options.include_usage`; then `data: [DONE]`. If the client disconnects, generation stops.

Logprobs are the model's raw logprobs at temperature 1, before top-k/top-p, as vLLM's default
(`services.engine.sampling` defines them). With `seed`, choice i samples from its own generator
seeded from (seed, i): the same request gives the same tokens; concurrent traffic batched with it
can change float rounding in the last bits, and so, very rarely, a sampled token (as in vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from msgspec import UNSET
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.metrics import ObservedApp
from services.common.tinymodel.tokenizer import ModelLoadError
from services.engine import completions, metrics
from services.engine.engine import Engine, Started
from services.engine.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    RequestError,
    Usage,
    decode_chat_request,
    decode_reload_request,
)
from services.engine.responses import chunk_choice, encode, event_stream, final_choice, generation_error, sse, usage
from services.engine.scheduler import EngineClosedError, GenerationFailedError

WEIGHTS_VERSION_HEADER = "x-rollwire-weights-version"


def _json(payload: Any, version: int, status: int = 200) -> Response:
    headers = {WEIGHTS_VERSION_HEADER: str(version)}
    return Response(encode(payload), status_code=status, media_type="application/json", headers=headers)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(started: Started, request: Request) -> bool:
    """Run a non-streaming request to the end; False if the client went away first (generation stopped)."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    watcher.add_done_callback(lambda _: started.job.cancel())
    try:
        async for _ in started.job.deltas():
            pass
        return not (watcher.done() and not watcher.cancelled())
    finally:
        watcher.cancel()


def _stream(engine: Engine, request: ChatCompletionRequest, started: Started) -> AsyncIterator[bytes]:
    chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[ChunkChoice], counts: Usage | None = None, first: bool = False) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=chunk_id,
                created=created,
                model=engine.served_name,
                choices=choices,
                usage=UNSET if counts is None else counts,
                prompt_token_ids=started.prompt_ids if first and request.return_token_ids else UNSET,
                weights_version=started.weights_version if first else UNSET,
            )
        )

    async def chunks() -> AsyncIterator[bytes]:
        roles = [ChunkChoice(index=b.index, delta=Delta(role="assistant", content="")) for b in started.builders]
        yield chunk(roles, first=True)
        async for deltas in started.job.deltas():
            yield chunk([chunk_choice(d, request) for d in deltas])

    return event_stream(
        started, chunks(), request.stream_options, lambda: chunk([], counts=usage(started.prompt_ids, started.builders))
    )


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
        return await _chat_completion(engine, http_request)

    @app.post("/v1/completions")
    async def completions(http_request: Request) -> Response:
        return await _completion(engine, http_request)

    @app.get("/v1/tokenizer")
    async def tokenizer() -> Response:
        return _json(engine.tokenizer_files(), engine.weights.version)

    @app.post("/reload")
    async def reload(http_request: Request) -> Response:
        request = decode_reload_request(await http_request.body())
        try:
            weights = await engine.reload(Path(request.path), request.weights_version)
        except ModelLoadError as exc:
            raise RequestError(str(exc), param="path", code="invalid_model") from None
        payload = {"model": engine.served_name, "path": str(weights.path), "weights_version": weights.version}
        return _json(payload, weights.version)


async def _answer(
    http_request: Request, started: Started, stream: AsyncIterator[bytes] | None, whole: Callable[[], Any]
) -> Response:
    """Stream the answer as SSE, or wait for it and answer `whole()` (499 when the client left first)."""
    headers = {WEIGHTS_VERSION_HEADER: str(started.weights_version)}
    if stream is not None:
        return StreamingResponse(
            stream, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
        )
    try:
        completed = await _collect(started, http_request)
    except (GenerationFailedError, EngineClosedError) as exc:
        return _json(generation_error(exc).body(), started.weights_version, status=500)
    if not completed:
        return Response(status_code=499)
    return _json(whole(), started.weights_version)


async def _chat_completion(engine: Engine, http_request: Request) -> Response:
    """`POST /v1/chat/completions`: stream the choices as SSE, or answer once they are complete."""
    request = decode_chat_request(await http_request.body())
    _check_model(engine, request.model)
    started = engine.start(request)

    def whole() -> ChatCompletion:
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=engine.served_name,
            choices=[final_choice(b, request) for b in started.builders],
            usage=usage(started.prompt_ids, started.builders),
            weights_version=started.weights_version,
            prompt_token_ids=started.prompt_ids if request.return_token_ids else UNSET,
        )

    return await _answer(http_request, started, _stream(engine, request, started) if request.stream else None, whole)


def _check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model != engine.served_name:
        raise RequestError(
            f"the model `{model}` does not exist; this engine serves `{engine.served_name}`",
            param="model",
            code="model_not_found",
            status=404,
        )


async def _completion(engine: Engine, http_request: Request) -> Response:
    """`POST /v1/completions`: a token-in completion (see `services.engine.completions`)."""
    request = completions.decode_completion_request(await http_request.body(), engine.weights.vocab_size)
    _check_model(engine, request.model)
    started = engine.start(completions.as_sampling_request(request), completions.prompt_ids(engine, request))
    stream = completions.stream(engine, request, started) if request.stream else None
    return await _answer(http_request, started, stream, lambda: completions.completion(engine, request, started))


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
    threads: int | None = None,
) -> FastAPI:
    """The engine's ASGI app over `model_dir` (or an existing `engine`, which the caller then owns).

    `threads`: torch threads of the generation thread (default: 1 for models under 100M parameters).
    """
    owned = engine is None
    if engine is None:
        if model_dir is None:
            raise ValueError("create_app needs model_dir or engine")
        engine = Engine(model_dir, served_name, seed, weights_version, max_model_len, threads)
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
    app.add_middleware(ObservedApp, service="engine")
    metrics.watch(lambda: served.scheduler.running, lambda: served.scheduler.queued, lambda: served.weights.version)
    _routes(app, served)
    _error_handlers(app)
    return app
