"""A recorded model call as the adapter reads it: `CallTokens`, its tokens and logprobs as arrays.

A call is read from a `ModelRequestRecorded` or from a `schemas.calls.CallRecord` (the same event
decoded with only the adapter's fields); the arrays are read straight from the packed bytes
(`schemas.refs.unpack_arrays`), and references are resolved by `schemas.refs.ArrayResolver`
(`resolved_calls`). Which of them train is `trainer.core.calls`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from schemas.calls import CallEvent
from schemas.refs import ArrayResolver, CallRef, UnresolvedReference, unpack_arrays, unpack_together
from trainer.core.tokens import FloatArray, IdArray, Logprobs, TokenIds


class MalformedCall(ValueError):
    """A successful call whose record cannot be trained on (no prompt ids, or logprobs missing)."""


class CallTokens(msgspec.Struct, frozen=True, kw_only=True):
    """One model call as the adapter sees it: the tokens consumed and sampled, and their logprobs.

    `logprobs[i]` is the behaviour log-probability of `response_ids[i]`; `choice_index` tells
    sibling choices of one request (`n > 1`) apart, so they are never taken for retries.
    `started_at` / `ended_at` (Unix seconds, None when unknown) tell a retry from a fan-out;
    `agent` and `model` (the registered model name) decide whether the run trains the call.
    Ids and logprobs are arrays when read from events (`trainer.core.tokens`); lists also do.
    """

    call_id: str
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: Logprobs
    weights_version: int | None = None
    choice_index: int = 0
    agent: str | None = None
    model: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    finish_reason: str | None = None
    event_id: str | None = None
    """The recorded event's id (None when unknown, or when the attempt recorded it twice)."""
    prompt_ref: str | None = None
    """The event id of the earlier call of the attempt this prompt was recorded as continuing, if any."""
    ref_tokens: int = 0
    """How many tokens of that call's prompt + response this prompt starts with (`prompt_ref.tokens`).

    With `event_id`, what lets `merge_calls` extend a chain without comparing token arrays; both are
    set by `rollout_calls` from the recorded reference, and must agree with `prompt_ids` when set.
    """

    def check_trainable(self) -> CallTokens:
        """This call, or `MalformedCall` when it lacks prompt ids or one logprob per response token."""
        if not len(self.prompt_ids):
            raise MalformedCall(
                f"call {self.call_id} has no prompt token ids; the engine must return token ids "
                "(vLLM: return_token_ids) for calls to be trainable"
            )
        if len(self.logprobs) != len(self.response_ids):
            raise MalformedCall(
                f"call {self.call_id} has {len(self.response_ids)} response tokens but {len(self.logprobs)} "
                "logprobs; the engine must return one logprob per sampled token"
            )
        return self


def call_from_event(event: CallEvent) -> CallTokens:
    """The adapter's view of a recorded call (its ids and logprobs as arrays).

    Raises `MalformedCall` when the record lacks what training needs: prompt token ids, and one
    logprob per response token. Both come from the engine (vLLM: `return_token_ids`, `logprobs`).
    """
    return context_call(event).check_trainable()


def context_call(event: CallEvent) -> CallTokens:
    """The adapter's view of a recorded call, unchecked (a context call need not be trainable).

    The call started at `started_at` (recorded since schema 2), else `latency_s` before it was
    recorded; it ended when it was recorded (`time`).
    """
    prompt, response, logprobs = call_arrays(event)
    return _call(event, prompt, response, logprobs, None)


def call_arrays(event: CallEvent) -> tuple[IdArray, IdArray, FloatArray]:
    """The recorded prompt ids (as recorded: after a reference, only the new ones), response ids and logprobs.

    Packed arrays are read straight into numpy arrays (no Python int per token); raises
    `MalformedCall` when they cannot be read.
    """
    try:
        return unpack_arrays(event)
    except (ValueError, TypeError) as exc:  # bad base64, or a length that is not whole values
        raise MalformedCall(f"call {event.call_id}: packed arrays unreadable: {exc}") from None


def calls_arrays(
    events: Sequence[CallEvent],
) -> tuple[list[tuple[IdArray, IdArray, FloatArray]], IdArray | None]:
    """`call_arrays` of an attempt's calls, all unpacked together, and the one array their ids
    were read from, if any (`schemas.refs.unpack_together`)."""
    try:
        return unpack_together(events)
    except (ValueError, TypeError):
        return [call_arrays(event) for event in events], None  # raises MalformedCall naming the call


def _call(
    event: CallEvent, prompt: IdArray, response: IdArray, logprobs: FloatArray, ref: CallRef | None
) -> CallTokens:
    started = event.started_at if event.started_at is not None else event.time - event.latency_s
    return CallTokens(
        call_id=event.call_id,
        prompt_ids=prompt,
        response_ids=response,
        logprobs=logprobs,
        weights_version=event.weights_version,
        choice_index=event.choice_index,
        agent=event.agent,
        model=event.endpoint or event.model,
        started_at=started if event.time else None,
        ended_at=event.time or None,
        temperature=event.temperature,
        top_p=event.top_p,
        top_k=event.top_k,
        finish_reason=event.finish_reason,
        event_id=event.event_id,
        prompt_ref=ref.event_id if ref else None,
        ref_tokens=ref.tokens if ref else 0,
    )


def resolved_calls(events: Sequence[CallEvent]) -> Iterator[CallTokens]:
    """The adapter's view of an attempt's `ok` calls, in stream order, each with its full prompt.

    A call recorded as a reference keeps it (`CallTokens.prompt_ref`, for `merge_calls`), except into
    an event id the attempt recorded twice; a repeated event id is dropped from the later call.
    Raises `MalformedCall` for a reference to a call not among the earlier ones.
    """
    arrays_of, joined = calls_arrays(events)
    resolver = ArrayResolver(joined)
    for event, (prompt, response, logprobs) in zip(events, arrays_of, strict=True):
        try:
            full, ref = resolver.prompt(event.event_id, event.prompt_ref, prompt, response)
        except UnresolvedReference as exc:
            raise MalformedCall(f"call {event.call_id}: {exc}") from None
        call = _call(event, full, response, logprobs, ref)
        if event.event_id in resolver.repeated:
            call = msgspec.structs.replace(call, event_id=None)
        yield call
