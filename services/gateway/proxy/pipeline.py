"""The one recording pipeline every front end's call goes through: forward, record, then answer.

A front end hands over a `Call`: the engine's chat-completions body (token ids and logprobs
requested), the request to record, and a `Translator` for its API. The pipeline posts the body
to the chosen endpoint, folds the answer (whole or streamed), appends one `ModelRequestRecorded`
per choice, and only after JetStream acknowledged it sends the answer (or, when streaming, the
part that finishes it), so every call the harness saw is a call the trainer will see. A client
that disconnects gets the upstream call cancelled and the call recorded as `aborted`; upstream
errors are recorded as `failed` and passed on with their status; timeouts become 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Any

import msgspec

from schemas import ModelRequestRecorded
from schemas.codec import encode
from schemas.runs import RunSpec
from services.common.eventstore import EventStoreUnavailable, EventTooLarge
from services.gateway import metrics
from services.gateway.asgi import SSE_HEADERS, DisconnectWatch, Receive, Send, send_json
from services.gateway.context import Gateway
from services.gateway.errors import unavailable
from services.gateway.proxy.budgets import Reservation
from services.gateway.proxy.call import Call, Outcome, Upstream
from services.gateway.proxy.continuity import Continuity
from services.gateway.proxy.frontends.base import error_body
from services.gateway.proxy.ledger import Charge
from services.gateway.proxy.limits import RECORD_OVERHEAD, asked, check_call, clamp_max_tokens, lower_max_tokens
from services.gateway.proxy.openai_format import (
    ChoiceRecord,
    StreamFold,
    decode_completion,
    int_usage,
    read_completion,
    sampling_params,
)
from services.gateway.proxy.payload import refusal
from services.gateway.proxy.promptids import PromptIdParser, PromptIds
from services.gateway.proxy.reaper import CallReaped
from services.gateway.proxy.recording import OutOfBounds, cut, not_recorded, out_of_bounds
from services.gateway.proxy.relay import relay_stream
from services.gateway.proxy.tokenin import ChunkConverter, chat_answer
from services.gateway.proxy.tokenin import decode_completion as decode_token_in
from services.gateway.proxy.upstream import UpstreamError, UpstreamResponse

WEIGHTS_HEADER = "x-rollwire-weights-version"
Prepared = tuple[list[ModelRequestRecorded], list[bytes]]
"""A call's events as they will be stored, and their encoded bytes."""


class Pipeline:
    """Forwards, records and answers calls (see the module docstring)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.continuity = Continuity()
        self.prompt_ids = PromptIdParser()

    async def run(self, call: Call, receive: Receive, send: Send) -> None:
        """Serve one call within the run's limits, the event store's and the attempt's budget, behind the phase gate."""
        gw = self.gw
        view = call.view
        settings = gw.state.spec(view.run_id)
        check_call(call.recorded_request, settings.limits)
        call.payload, call.recorded_request = clamp_max_tokens(call.payload, call.recorded_request, settings.limits)
        # The payload as sent upstream bounds the request copy; only a call that might not fit pays for
        # finding what its attempt's earlier calls already hold.
        why = refusal(gw.store.max_payload, len(call.payload), call.recorded_request)
        if why is not None:
            new = gw.chains.new_request_bytes((view.run_id, view.rollout_id, call.attempt_id), call.recorded_request)
            why = refusal(gw.store.max_payload, new, call.recorded_request)
        if why is not None:  # before the gate and the engine: nothing is generated for a call we cannot keep
            await self._fail(call, send, 413, why, "invalid_request_error")
            await gw.budgets.charge(view, call.attempt_id, settings.budget, call.spent(Charge()), call.seqs)
            return
        if gw.store.refusing is not None:  # a full store: refused before generation (its failed record probes it)
            await self._fail(call, send, 503, f"{gw.store.refusing}; nothing was generated")
            await gw.budgets.charge(view, call.attempt_id, settings.budget, call.spent(Charge()), call.seqs)
            return
        if settings.prompt_mode == "continuous":
            await self.continuity.prepare(gw, call)
        # Stamped before the budget and the phase gate: twins of a fan-out held there while the
        # other finished still overlap it, so the trainer does not take the first for a retry.
        call.started_at = time.time()
        reservation = await self._reserve(call, settings)
        try:
            await self._gated(call, receive, send)
        finally:
            if reservation is not None:
                await gw.budgets.settle(reservation, call.spent(reservation.charge), call.seqs)

    async def _reserve(self, call: Call, settings: RunSpec) -> Reservation | None:
        """Reserve the call against its attempt's budget, its `max_tokens` lowered to what is left."""
        prompt, n, max_tokens = asked(call.payload, call.recorded_request, settings.limits, call.prompt_size)
        size = len(call.payload) + RECORD_OVERHEAD
        budgets = self.gw.budgets
        reservation = await budgets.reserve(
            call.view, call.attempt_id, settings.budget, prompt=prompt, n=n, max_tokens=max_tokens, size=size
        )
        if reservation is not None and reservation.max_tokens < max_tokens:
            call.payload, call.recorded_request = lower_max_tokens(
                call.payload, call.recorded_request, reservation.max_tokens
            )
        return reservation

    async def _gated(self, call: Call, receive: Receive, send: Send) -> None:
        """Forward the call behind the phase gate, known to the reaper while it is in flight."""
        gw, view = self.gw, call.view
        gate = gw.gate
        await gate.enter(view.run_id)
        try:
            call.started = time.perf_counter()
            if call.stream:
                await self._stream(call, receive, send)
            else:
                await self._complete(call, receive, send)
        finally:
            if gw.reaper is not None:
                gw.reaper.ended(call.call_id)
            gate.leave(view.run_id)

    # ---- recording -----------------------------------------------------------------------------

    def _weights(self, call: Call, raw: str | None) -> int | None:
        if raw is not None and raw.lstrip("-").isdigit():
            return int(raw)
        if call.model.weights_version is not None:
            return call.model.weights_version
        phase = self.gw.state.phase(call.view.run_id)
        return phase.weights_version if phase else None

    def events(self, call: Call, outcome: Outcome) -> list[ModelRequestRecorded]:
        """One `model_request` event per choice (one event without choices for a failed call).

        A prompt parsed into an int32 array is not copied into them: `record` hands it to
        `CallChains.compact` beside the events."""
        view, call_id = call.view, call.call_id
        common: dict[str, Any] = {
            "run_id": view.run_id,
            "rollout_id": view.rollout_id,
            "attempt_id": call.attempt_id,
            "call_id": call_id,
            "mode": call.mode,
            "status": outcome.status,
            "model": outcome.model or call.model.upstream_model,
            "weights_version": self._weights(call, outcome.weights),
            "prompt_ids": outcome.prompt_ids if isinstance(outcome.prompt_ids, list) else [],
            "request": call.recorded_request,
            "usage": int_usage(outcome.usage),
            "latency_s": time.perf_counter() - call.started,
            "error": outcome.error,
            "api": call.api,
            "agent": call.agent,
            "endpoint": call.model.name,
            "started_at": call.started_at,
            **sampling_params(call.recorded_request),
        }
        if call.continuity is not None:
            common["continuity"] = call.continuity
        if not outcome.records:
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
            for r in outcome.records
        ]

    async def record(self, call: Call, outcome: Outcome) -> None:
        """Append the call's terminal events, once per call (raises `EventStoreUnavailable`, `CallReaped`,
        or `OutOfBounds` after recording as failed an answer the contract cannot hold)."""
        call.note(outcome)  # what the engine spent counts, whoever records the call
        verdict = await self.gw.reaper.send_claim(call.call_id) if self.gw.reaper is not None else None
        events: list[ModelRequestRecorded] = []
        prepared: Prepared | None = None
        try:  # built, compacted and encoded while the claim travels; nothing is sent
            events, why = self._bounded(call, outcome)
            if why is None:
                prepared = self._prepare(events, outcome.prompt_ids)
        except OutOfBounds as exc:  # token ids found outside the bounds while packing them
            why = exc.why
        finally:
            won = True if verdict is None else await verdict
        if not won:
            self.gw.chains.drop(events)
            raise CallReaped(call.call_id)  # a reaper recorded it `aborted`: one terminal record per call
        if why is None:
            await self._append_or_cut(call, events, outcome.status == "ok", prepared)
            return
        # Recorded as failed, without what does not fit; the caller answers 502.
        status = "failed" if outcome.status == "ok" else outcome.status
        failed = self.events(call, Outcome(status=status, error=f"{OutOfBounds.prefix}: {why}"))
        await self._append_or_cut(call, failed)
        raise OutOfBounds(why)

    async def _append_or_cut(
        self, call: Call, events: list[ModelRequestRecorded], ok: bool = False, prepared: Prepared | None = None
    ) -> None:
        """Append the events; a failed call's too large events are appended cut (an `ok` one raises)."""
        try:
            try:
                await self._append(call, events, prepared)
            except EventTooLarge as exc:
                if ok:
                    raise
                reason = str(exc)
                await self._append(call, [cut(event, reason) for event in events])
        except OutOfBounds:
            raise
        except BaseException:
            metrics.record_failed()
            raise
        metrics.recorded(events)

    def _bounded(self, call: Call, outcome: Outcome) -> tuple[list[ModelRequestRecorded], str | None]:
        """The call's events and, when the engine's answer holds what the contract refuses, why."""
        try:
            events = self.events(call, outcome)
        except msgspec.ValidationError as exc:  # a weights version outside int32, say
            return [], str(exc)
        return events, out_of_bounds(events)

    def _prepare(self, events: list[ModelRequestRecorded], prompt_ids: PromptIds | None = None) -> Prepared:
        """The events as they will be stored (compacted against the attempt's earlier calls) and their bytes."""
        stored = self.gw.chains.compact(events, prompt_ids)
        return stored, [encode(event) for event in stored]

    async def _append(self, call: Call, events: list[ModelRequestRecorded], prepared: Prepared | None = None) -> None:
        store, chains = self.gw.store, self.gw.chains
        try:
            stored, encoded = self._prepare(events) if prepared is None else prepared
            if len(stored) == 1:
                appended = [await store.append(stored[0], encoded=encoded[0])]
            else:
                appended = await store.append_many(stored, encoded)
        except BaseException:
            chains.drop(events)
            raise
        chains.remember(events, appended)
        call.seqs = [a.seq for a in appended]
        call.record_bytes = sum(len(data) for event, data in zip(stored, encoded, strict=True) if event.status != "ok")

    async def _too_large(self, call: Call, outcome: Outcome, exc: EventTooLarge) -> str:
        """Record a generated call whose event does not fit as failed; the message for the client."""
        message = f"this call's answer cannot be recorded ({exc}); send a smaller max_tokens or a shorter prompt"
        await self._record_quietly(
            call, Outcome(status="failed", error=message, usage=outcome.usage, weights=outcome.weights)
        )
        return message

    async def _record_quietly(self, call: Call, outcome: Outcome) -> None:
        with contextlib.suppress(EventStoreUnavailable, OutOfBounds):
            await self.record(call, outcome)

    async def _fail(self, call: Call, send: Send, status: int, message: str, kind: str | None = None) -> None:
        await self._record_quietly(call, Outcome(status="failed", error=message))
        await send_json(send, status, error_body(call.translator.api, status, message, kind))

    # ---- non-streamed --------------------------------------------------------------------------

    def _headers(self, call: Call) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if call.model.api_key:
            headers["authorization"] = f"Bearer {call.model.api_key}"
        return headers

    async def _request(self, call: Call) -> UpstreamResponse:
        """Send the call to its endpoint; the call's marker is put once the engine's request is written
        (first the request, then the marker, whose ack comes back while the engine works)."""
        reaper, view = self.gw.reaper, call.view
        started = None
        if reaper is not None:
            marker = (view.run_id, view.rollout_id, call.attempt_id, call.call_id, call.mode, call.model.name)
            started = functools.partial(reaper.started, *marker)
        url = f"{call.model.base_url}{call.endpoint}"
        return await self.gw.upstream.request("POST", url, call.payload, self._headers(call), started)

    async def _post(self, call: Call) -> Upstream:
        response = await self._request(call)
        try:
            content = await response.read()
        except BaseException:
            response.close()  # abandoned mid-answer (client gone, timeout): the connection is closed
            raise
        return Upstream(response.status, response.headers.get(WEIGHTS_HEADER), content)

    async def _complete(self, call: Call, receive: Receive, send: Send) -> None:
        watch = DisconnectWatch(receive)
        error: BaseException | None = None
        upstream: Upstream | None = None
        try:
            upstream = await self._post(call)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
        except UpstreamError as exc:
            error = exc
        finally:
            watch.stop()
        if watch.gone:
            watch.task.uncancel()
            await self._record_quietly(
                call, Outcome(status="aborted", error="the client disconnected before the answer")
            )
            return
        await self._answer(call, upstream, error, send)

    async def _answer(self, call: Call, upstream: Upstream | None, error: BaseException | None, send: Send) -> None:
        """Record a non-streamed call and answer the client (the answer only after the record is acked)."""
        if isinstance(error, TimeoutError):
            await self._fail(call, send, 504, "the model endpoint timed out", "timeout")
            return
        if error is not None or upstream is None:
            await self._fail(call, send, 502, f"the model endpoint failed: {error!r}")
            return
        if upstream.status >= 400:
            await self._pass_error(call, upstream, send)
            return
        try:
            answer, content, prompt_ids, records = self._read(call, upstream.content)
        except (msgspec.DecodeError, msgspec.ValidationError):
            await self._fail(call, send, 502, "the model endpoint answered with invalid JSON")
            return
        outcome = Outcome(
            status="ok",
            prompt_ids=prompt_ids,
            records=records,
            usage=answer.get("usage"),
            weights=upstream.weights,
            model=answer.get("model"),
        )
        try:
            await self.record(call, outcome)
        except EventStoreUnavailable as exc:
            raise unavailable(not_recorded(exc)) from None
        except OutOfBounds as exc:
            await send_json(send, 502, error_body(call.translator.api, 502, str(exc)))
            return
        except EventTooLarge as exc:
            message = await self._too_large(call, outcome, exc)
            await send_json(send, 413, error_body(call.translator.api, 413, message, "invalid_request_error"))
            return
        await send_json(send, 200, call.translator.complete(answer, content, records))

    def _read(self, call: Call, content: bytes) -> tuple[dict[str, Any], bytes | None, PromptIds, list[ChoiceRecord]]:
        """The engine's answer decoded, the bytes to answer with unless it must be encoded anew, and its
        prompt ids and choices (raises `msgspec.DecodeError` or `ValidationError` for bad JSON, ids included)."""
        answer = (decode_token_in if call.token_in else decode_completion)(content)
        if call.token_in:  # answered as chat: the engine's bytes are not the answer
            answer = chat_answer(answer, call.parse_tools, call.parse_reasoning)
        key = (call.view.run_id, call.view.rollout_id, call.attempt_id)
        prompt_ids, records = read_completion(answer, lambda value: self.prompt_ids.parse(key, value))
        return answer, None if call.token_in else content, prompt_ids, records

    async def _pass_error(self, call: Call, upstream: Upstream, send: Send) -> None:
        call.used = 0  # the engine refused the call: nothing was generated
        text = upstream.content.decode(errors="replace")
        await self._record_quietly(
            call, Outcome(status="failed", error=f"HTTP {upstream.status}: {text[:2000]}", weights=upstream.weights)
        )
        await send_json(send, upstream.status, call.translator.upstream_error(upstream.status, upstream.content))

    # ---- streamed ------------------------------------------------------------------------------

    async def _stream(self, call: Call, receive: Receive, send: Send) -> None:
        try:
            response = await self._request(call)
        except TimeoutError:
            await self._fail(call, send, 504, "the model endpoint timed out", "timeout")
            return
        except UpstreamError as exc:
            await self._fail(call, send, 502, f"the model endpoint failed: {exc}")
            return
        finished = False
        try:
            if response.status >= 400:
                content = await response.read()
                finished = True
                await self._pass_error(
                    call, Upstream(response.status, response.headers.get(WEIGHTS_HEADER), content), send
                )
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
        translator = call.translator
        opening = translator.begin()
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if opening:
            await send({"type": "http.response.body", "body": opening, "more_body": True})
        convert = ChunkConverter(call.parse_tools, call.parse_reasoning) if call.token_in else None
        watch = DisconnectWatch(receive)
        error: Exception | None = None
        try:
            await relay_stream(response, fold, held, translator, send, convert)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            watch.task.uncancel()
        except Exception as exc:  # the engine broke off, or went silent past the read timeout
            error = exc
        finally:
            watch.stop()
        weights = response.headers.get(WEIGHTS_HEADER)
        seen = Outcome(
            status="ok",
            prompt_ids=fold.prompt_ids,
            records=fold.records(),
            usage=fold.usage,
            weights=weights,
            model=fold.model,
        )
        call.note(seen)  # what reached the gateway is charged, however the call ends
        if watch.gone:
            seen.status, seen.error = "aborted", "the client disconnected mid-stream"
            await self._record_quietly(call, seen)
            return False
        if error is not None:
            await self._broke(call, error, weights, send)
            return False
        return await self._finish(call, seen, fold, held, send)

    async def _broke(self, call: Call, error: BaseException, weights: str | None, send: Send) -> None:
        """Record a stream the engine broke off (or that timed out) as failed, and end it with an error event."""
        timed_out = isinstance(error, TimeoutError)
        message = (
            "the model endpoint timed out mid-stream"
            if timed_out
            else f"the model endpoint failed mid-stream: {error!r}"
        )
        await self._record_quietly(call, Outcome(status="failed", error=message, weights=weights))
        body = call.translator.stream_error(504 if timed_out else 502, message)
        await send({"type": "http.response.body", "body": body})

    async def _finish(self, call: Call, seen: Outcome, fold: StreamFold, held: list[bytes], send: Send) -> bool:
        """Record a whole stream, then send what was held back and its end; True when that worked."""
        translator = call.translator
        try:
            await self.record(call, seen)
        except EventStoreUnavailable as exc:
            await send({"type": "http.response.body", "body": translator.stream_error(503, not_recorded(exc))})
            return False
        except OutOfBounds as exc:
            await send({"type": "http.response.body", "body": translator.stream_error(502, str(exc))})
            return False
        except EventTooLarge as exc:
            message = await self._too_large(call, seen, exc)
            await send({"type": "http.response.body", "body": translator.stream_error(413, message)})
            return False
        held.append(translator.end(fold))
        await send({"type": "http.response.body", "body": b"".join(held)})
        return True
