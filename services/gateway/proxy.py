"""The OpenAI-compatible proxy: one agent's model calls, forwarded and recorded token by token.

    POST /proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1/chat/completions
    GET  /proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1/models

This is the hot path, so it is a plain ASGI handler (no routing or validation framework in the
way), admission is checked against the in-memory state (`state.py`), the upstream is one pooled
`UpstreamClient` (`upstream.py`, a lean HTTP/1.1 client), and JSON goes through msgspec.

For each call: check the attempt token and that the attempt is live (403 foreign, 404 unknown,
409 finished; nothing is forwarded otherwise), refuse with 503 when NATS is down, pass the phase
gate, forward with token ids and logprobs requested, append one `ModelRequestRecorded` per choice,
and only after JetStream acknowledged it return the response (or, when streaming, the chunks that
finish the choices and `[DONE]`), so every call the harness saw is a call the trainer will see.
A client that disconnects gets the upstream call cancelled and the call recorded as `aborted`.
Upstream errors are recorded as `failed` and passed on with their status; timeouts become 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from schemas import ModelRequestRecorded, new_id
from services.common.eventstore import EventStoreUnavailable
from services.gateway import metrics
from services.gateway.auth import AttemptScope, Principal
from services.gateway.context import Gateway
from services.gateway.errors import ApiError, forbidden, not_found, translate, unauthorized, unavailable
from services.gateway.openai_format import (
    ChoiceRecord,
    StreamFold,
    Wants,
    finishes,
    int_usage,
    prepare_request,
    read_completion,
    strip_chunk,
    strip_completion,
)
from services.gateway.readmodel import RolloutView
from services.gateway.state import ModelEntry
from services.gateway.upstream import UpstreamError, UpstreamResponse

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PREFIX = "/proxy/rollout/"
WEIGHTS_HEADER = "x-rollwire-weights-version"
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_encode = msgspec.json.Encoder().encode
_decode_obj = msgspec.json.Decoder(dict[str, Any]).decode
_decode_any = msgspec.json.Decoder().decode


class Upstream(msgspec.Struct):
    """An upstream answer read in full: status, the weights version header, body bytes."""

    status: int
    weights: str | None
    content: bytes


class Call(msgspec.Struct, kw_only=True):
    """One admitted call: who, where to, and what the client asked for."""

    view: RolloutView
    attempt_id: str
    mode: str
    model: ModelEntry
    body: dict[str, Any]
    wants: Wants
    started: float


async def _send_json(send: Send, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS + extra})
    await send({"type": "http.response.body", "body": payload})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")  # type: ignore[no-any-return]
    return None


def _openai_error(status: int, message: str, kind: str = "upstream_error") -> bytes:
    return _encode({"error": {"message": message, "type": kind, "code": status}})


class Proxy:
    """ASGI handler for `/proxy/...` (mounted in front of the API by `app.py`)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._dispatch(scope, receive, tracked)
        except Exception as exc:
            error = translate(exc)
            if started:  # a stream already began: nothing more can be said over HTTP
                if error is None:
                    raise
                return
            if error is None:
                error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
            await _send_json(send, error.status, error.body(), error.headers)
            if error.status == 500:
                raise

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts = scope["path"][len(PREFIX) :].split("/")
        # rid / attempt / aid / mode / m / openai / v1 / rest...
        if len(parts) < 8 or parts[1] != "attempt" or parts[3] != "mode" or parts[5:7] != ["openai", "v1"]:
            raise not_found("unknown proxy path; use /proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1/")
        rollout_id, attempt_id, mode, rest = parts[0], parts[2], parts[4], "/".join(parts[7:])
        if mode not in ("train", "val"):
            raise not_found(f"unknown proxy mode {mode!r}; use train or val")
        method = scope["method"]
        if rest == "chat/completions" and method == "POST":
            view = await self._admit(scope, rollout_id, attempt_id, mode)
            await self._chat(scope, receive, send, view, attempt_id, mode)
        elif rest == "models" and method == "GET":
            view = await self._admit(scope, rollout_id, attempt_id, mode)
            await self._models(send, view, rollout_id)
        else:
            raise not_found(f"the proxy serves POST chat/completions and GET models, not {method} {rest}")

    # ---- admission -----------------------------------------------------------------------------

    async def _admit(self, scope: Scope, rollout_id: str, attempt_id: str, mode: str) -> RolloutView:
        gw = self.gw
        principal: Principal | None = gw.auth.principal(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
        if principal is None:
            raise unauthorized()
        if isinstance(principal, AttemptScope):
            if principal.role != "agent":
                raise forbidden("an evaluator token cannot call the model through the proxy")
            if (principal.rollout_id, principal.attempt_id) != (rollout_id, attempt_id):
                raise forbidden(
                    f"this token belongs to rollout {principal.rollout_id} attempt "
                    f"{principal.attempt_id}, not rollout {rollout_id} attempt {attempt_id}"
                )
        view = await gw.rollout_for(principal, rollout_id)
        if isinstance(principal, AttemptScope) and principal.run_id != view.run_id:
            raise forbidden(f"this token belongs to run {principal.run_id}")
        attempt = view.attempt(attempt_id)
        if attempt is None:
            view = await gw.rollout_for(principal, rollout_id, refresh=True)
            attempt = view.attempt(attempt_id)
            if attempt is None:
                raise not_found(f"rollout {rollout_id} has no attempt {attempt_id}")
        if attempt.ended:
            raise ApiError(
                409,
                f"attempt {attempt_id} of rollout {rollout_id} has ended ({view.status}); "
                "its calls are no longer accepted",
                current={"status": view.status, "attempt_id": view.attempt_id},
            )
        if mode != view.mode:
            raise ApiError(409, f"rollout {rollout_id} is a {view.mode} rollout; use mode/{view.mode} in the URL")
        if not gw.store.nc.is_connected:
            raise unavailable("the event store (NATS) is unavailable, so the call cannot be recorded; retry later")
        return view

    def _choose(self, view: RolloutView, requested: Any) -> ModelEntry:
        models = self.gw.state.models_for(view.run_id, self.gw.settings.default_run)
        if not models:
            raise unavailable(
                f"no model endpoint is registered for run {view.run_id}; register one with POST /api/models"
            )
        matching = [m for m in models if requested in (m.name, m.served_model)]
        pool = sorted(matching or models, key=lambda m: m.name)
        # A rollout sticks to one endpoint (its prefix cache), spread by a hash of its id.
        digest = hashlib.blake2b(view.rollout_id.encode(), digest_size=8).digest()
        return pool[int.from_bytes(digest, "big") % len(pool)]

    # ---- models --------------------------------------------------------------------------------

    async def _models(self, send: Send, view: RolloutView, rollout_id: str) -> None:
        model = self._choose(view, None)
        headers = {"authorization": f"Bearer {model.api_key}"} if model.api_key else {}
        try:
            response = await self.gw.upstream.request("GET", f"{model.base_url}/models", b"", headers)
            status, content = response.status, await response.read()
        except TimeoutError:
            raise ApiError(504, f"the model endpoint {model.base_url} timed out") from None
        except UpstreamError as exc:
            raise ApiError(502, f"the model endpoint {model.base_url} failed: {exc}") from None
        await _send_json(send, status, content)

    # ---- chat completions ----------------------------------------------------------------------

    async def _chat(
        self, scope: Scope, receive: Receive, send: Send, view: RolloutView, attempt_id: str, mode: str
    ) -> None:
        gw = self.gw
        body = await self._read_body(scope, receive)
        try:
            request = _decode_obj(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ApiError(422, f"the request body is not a JSON object: {exc}", field="body") from None
        if not isinstance(request.get("messages"), list):
            raise ApiError(422, 'chat completions need a list of "messages"', field="messages")
        model = self._choose(view, request.get("model"))
        await gw.gate.enter(view.run_id)
        try:
            upstream_body, wants = prepare_request(request, model.upstream_model)
            call = Call(
                view=view,
                attempt_id=attempt_id,
                mode=mode,
                model=model,
                body=request,
                wants=wants,
                started=time.perf_counter(),
            )
            payload = _encode(upstream_body)
            if request.get("stream"):
                await self._stream(call, payload, receive, send)
            else:
                await self._complete(call, payload, receive, send)
        finally:
            gw.gate.leave(view.run_id)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.gw.settings.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is larger than the limit of {limit} bytes")
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError(499, "the client disconnected before sending its request")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body is larger than the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body"):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _headers(self, call: Call) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if call.model.api_key:
            headers["authorization"] = f"Bearer {call.model.api_key}"
        return headers

    def _weights(self, call: Call, raw: str | None) -> int | None:
        if raw is not None and raw.lstrip("-").isdigit():
            return int(raw)
        if call.model.weights_version is not None:
            return call.model.weights_version
        phase = self.gw.state.phases.get(call.view.run_id)
        return phase.weights_version if phase else None

    def _events(
        self,
        call: Call,
        *,
        status: str,
        prompt_ids: list[int],
        records: list[ChoiceRecord],
        usage: Any,
        weights: int | None,
        error: str | None = None,
        model: str | None = None,
    ) -> list[ModelRequestRecorded]:
        call_id = new_id()
        latency = time.perf_counter() - call.started
        view = call.view
        common: dict[str, Any] = {
            "run_id": view.run_id,
            "rollout_id": view.rollout_id,
            "attempt_id": call.attempt_id,
            "call_id": call_id,
            "mode": call.mode,
            "status": status,
            "model": model or call.model.upstream_model,
            "weights_version": weights,
            "prompt_ids": prompt_ids,
            "request": call.body,
            "usage": int_usage(usage),
            "latency_s": latency,
            "error": error,
        }
        if not records:
            return [ModelRequestRecorded(event_id=f"{call_id}-0", **common)]
        return [
            ModelRequestRecorded(
                event_id=f"{call_id}-{r.index}",
                choice_index=r.index,
                response_ids=r.token_ids,
                logprobs=r.logprobs,
                finish_reason=r.finish_reason,
                response=r.response(),
                **common,
            )
            for r in records
        ]

    async def _record(self, events: list[ModelRequestRecorded]) -> None:
        store = self.gw.store
        try:
            if len(events) == 1:
                await store.append(events[0])
            else:
                await store.append_many(events)
        except BaseException:
            metrics.record_failed()
            raise
        metrics.recorded(events)

    async def _record_failure(self, call: Call, error: str, weights: str | None = None) -> None:
        with contextlib.suppress(EventStoreUnavailable):
            await self._record(
                self._events(
                    call,
                    status="failed",
                    prompt_ids=[],
                    records=[],
                    usage=None,
                    weights=self._weights(call, weights),
                    error=error,
                )
            )

    async def _post(self, call: Call, payload: bytes) -> Upstream:
        url = f"{call.model.base_url}/chat/completions"
        response = await self.gw.upstream.request("POST", url, payload, self._headers(call))
        try:
            content = await response.read()
        except BaseException:
            response.close()  # abandoned mid-answer (client gone, timeout): the connection is closed
            raise
        return Upstream(response.status, response.headers.get(WEIGHTS_HEADER), content)

    async def _complete(self, call: Call, payload: bytes, receive: Receive, send: Send) -> None:
        me = asyncio.current_task()
        assert me is not None
        gone = False

        async def cancel_on_disconnect() -> None:
            nonlocal gone
            await _disconnected(receive)
            gone = True
            me.cancel()  # closes the upstream connection: the engine stops generating

        watcher = asyncio.get_running_loop().create_task(cancel_on_disconnect())
        error: BaseException | None = None
        upstream: Upstream | None = None
        try:
            upstream = await self._post(call, payload)
        except asyncio.CancelledError:
            if not gone:
                raise
        except UpstreamError as exc:
            error = exc
        finally:
            watcher.cancel()
        if gone:
            me.uncancel()
            with contextlib.suppress(EventStoreUnavailable):
                await self._record(
                    self._events(
                        call,
                        status="aborted",
                        prompt_ids=[],
                        records=[],
                        usage=None,
                        weights=self._weights(call, None),
                        error="the client disconnected before the answer",
                    )
                )
            return
        await self._answer(call, upstream, error, send)

    async def _answer(self, call: Call, upstream: Upstream | None, error: BaseException | None, send: Send) -> None:
        """Record a non-streamed call and answer the client (the answer only after the record is acked)."""
        if isinstance(error, TimeoutError):
            await self._record_failure(call, "the model endpoint timed out")
            await _send_json(send, 504, _openai_error(504, "the model endpoint timed out", "timeout"))
            return
        if error is not None or upstream is None:
            await self._record_failure(call, f"the model endpoint failed: {error!r}")
            await _send_json(send, 502, _openai_error(502, f"the model endpoint failed: {error!r}"))
            return
        if upstream.status >= 400:
            await self._pass_error(call, upstream, send)
            return
        try:
            answer = _decode_obj(upstream.content)
        except (msgspec.DecodeError, msgspec.ValidationError):
            await self._record_failure(
                call, "the model endpoint answered with something that is not JSON", upstream.weights
            )
            await _send_json(send, 502, _openai_error(502, "the model endpoint answered with invalid JSON"))
            return
        prompt_ids, records = read_completion(answer)
        events = self._events(
            call,
            status="ok",
            prompt_ids=prompt_ids,
            records=records,
            usage=answer.get("usage"),
            weights=self._weights(call, upstream.weights),
            model=answer.get("model"),
        )
        try:
            await self._record(events)
        except EventStoreUnavailable:
            raise unavailable("the call could not be recorded (NATS unavailable); retry it") from None
        wants = call.wants
        if wants.token_ids and wants.logprobs:
            out = upstream.content
        else:
            strip_completion(answer, wants)
            out = _encode(answer)
        await _send_json(send, 200, out)

    async def _pass_error(self, call: Call, upstream: Upstream, send: Send) -> None:
        text = upstream.content.decode(errors="replace")
        await self._record_failure(call, f"HTTP {upstream.status}: {text[:2000]}", upstream.weights)
        try:
            body = _decode_any(upstream.content)
        except msgspec.DecodeError:
            body = None
        if isinstance(body, dict) and "error" in body:
            payload = upstream.content
        else:
            payload = _openai_error(upstream.status, text[:2000] or f"the model endpoint answered {upstream.status}")
        await _send_json(send, upstream.status, payload)

    async def _stream(self, call: Call, payload: bytes, receive: Receive, send: Send) -> None:
        url = f"{call.model.base_url}/chat/completions"
        try:
            response = await self.gw.upstream.request("POST", url, payload, self._headers(call))
        except TimeoutError:
            await self._record_failure(call, "the model endpoint timed out")
            await _send_json(send, 504, _openai_error(504, "the model endpoint timed out", "timeout"))
            return
        except UpstreamError as exc:
            await self._record_failure(call, f"the model endpoint failed: {exc}")
            await _send_json(send, 502, _openai_error(502, f"the model endpoint failed: {exc}"))
            return
        finished = False
        try:
            if response.status >= 400:
                content = await response.read()
                finished = True
                upstream = Upstream(response.status, response.headers.get(WEIGHTS_HEADER), content)
                await self._pass_error(call, upstream, send)
                return
            finished = await self._pump(call, response, receive, send)
        finally:
            # A finished stream returns its connection to the pool; an abandoned one closes it,
            # which is how the engine learns to stop generating.
            if finished:
                response.release()
            else:
                response.close()

    async def _pump(self, call: Call, response: UpstreamResponse, receive: Receive, send: Send) -> bool:
        """Relay the stream; record the call; True when it ended normally."""
        fold = StreamFold()
        held: list[bytes] = []
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        relay = asyncio.ensure_future(_relay(response, fold, held, call.wants, send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((relay, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        weights = self._weights(call, response.headers.get(WEIGHTS_HEADER))
        if not relay.done():
            relay.cancel()
            with contextlib.suppress(BaseException):
                await relay
            with contextlib.suppress(EventStoreUnavailable):
                await self._record(
                    self._events(
                        call,
                        status="aborted",
                        prompt_ids=fold.prompt_ids,
                        records=fold.records(),
                        usage=fold.usage,
                        weights=weights,
                        error="the client disconnected mid-stream",
                        model=fold.model,
                    )
                )
            return False
        error = relay.exception()
        if error is not None:
            timed_out = isinstance(error, TimeoutError)
            message = (
                "the model endpoint timed out mid-stream"
                if timed_out
                else f"the model endpoint failed mid-stream: {error!r}"
            )
            await self._record_failure(call, message, response.headers.get(WEIGHTS_HEADER))
            await _send_sse_error(send, 504 if timed_out else 502, message)
            return False
        events = self._events(
            call,
            status="ok",
            prompt_ids=fold.prompt_ids,
            records=fold.records(),
            usage=fold.usage,
            weights=weights,
            model=fold.model,
        )
        try:
            await self._record(events)
        except EventStoreUnavailable:
            await _send_sse_error(send, 503, "the call could not be recorded (NATS unavailable); retry it")
            return False
        held.append(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"".join(held)})
        return True


async def _disconnected(receive: Receive) -> None:
    """Return when the client goes away (the request body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _send_sse_error(send: Send, status: int, message: str) -> None:
    await send({"type": "http.response.body", "body": b"data: " + _openai_error(status, message) + b"\n\n"})


async def _relay(response: UpstreamResponse, fold: StreamFold, held: list[bytes], wants: Wants, send: Send) -> None:
    """Forward SSE events as they arrive, folding each; hold back the ones that finish a choice."""
    passthrough = wants.token_ids and wants.logprobs and wants.usage_chunk
    buffer = b""
    async for raw in response.iter_chunks():
        buffer += raw
        if b"\r\n" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        if b"\n\n" not in buffer:
            continue
        *events, buffer = buffer.split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            data = b"".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if not data or data == b"[DONE]":
                continue
            try:
                chunk = _decode_obj(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            fold.feed(chunk)
            if fold.model is None and isinstance(chunk.get("model"), str):
                fold.model = chunk["model"]
            keep = True
            if not passthrough:
                keep = strip_chunk(chunk, wants)
                data = _encode(chunk)
            if not keep:
                continue
            line = b"data: " + data + b"\n\n"
            if finishes(chunk) or (not chunk.get("choices") and chunk.get("usage")):
                held.append(line)
            else:
                out.append(line)
        if out:
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
