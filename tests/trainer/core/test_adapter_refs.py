"""Merging through recorded references gives the samples that comparing token arrays gives.

A version-2 call that continues an earlier one is recorded as a `prompt_ref` and its new ids;
`rollout_calls` resolves it and keeps the reference on the `CallTokens`, and `merge_calls` extends the
chain the reference names without comparing tokens. Each history below is recorded both ways (in
full, and compacted as a writer does it, through the wire encoding), and every scheme must give
the same samples: from the compact history, from the full one, and from the compact one with the
references removed (the comparison alone).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count, pairwise

import msgspec
import numpy as np
import pytest
from msgspec import UNSET

from schemas import (
    AttemptStarted,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    decode,
    encode,
)
from schemas.refs import CallRef, pack
from trainer.core import AdapterConfig, RolloutCalls, merge_calls, merge_rollouts, plain, rollout_calls

RUN = "refs"
CONFIGS = [
    AdapterConfig(),
    AdapterConfig(max_length=12),
    AdapterConfig(merge="per-call"),
]
_numbers = count()


class History:
    """One rollout's events, built call by call; `missing` calls happened but are not on the stream."""

    def __init__(self, rollout_id: str) -> None:
        self.rollout_id = rollout_id
        self.events: list[Event] = [
            RolloutCreated(run_id=RUN, rollout_id=rollout_id, group_id="g"),
            AttemptStarted(run_id=RUN, rollout_id=rollout_id, attempt_id="a1", sequence=1),
        ]
        self.missing: set[str] = set()
        self.clock = 100.0

    def call(
        self,
        prompt: list[int],
        response: list[int],
        *,
        temperature: float | None = None,
        missing: bool = False,
        concurrent: bool = False,
    ) -> ModelRequestRecorded:
        """Append a call that ended before the next one starts (`concurrent`: ran alongside the previous one)."""
        n = next(_numbers)
        self.clock += 0.0 if concurrent else 1.0
        event = ModelRequestRecorded(
            run_id=RUN, rollout_id=self.rollout_id, attempt_id="a1", call_id=f"c{n}", prompt_ids=prompt,
            response_ids=response, logprobs=[-(n + 1) - i / 8 for i in range(len(response))],
            started_at=self.clock, time=self.clock + 0.5, temperature=temperature, weights_version=n % 3,
        )  # fmt: skip
        self.events.append(event)
        if missing:
            self.missing.add(event.event_id)
        return event

    def again(self, event: ModelRequestRecorded) -> None:
        """The same event on the stream a second time (re-sent after the duplicate window)."""
        self.events.append(event)

    def end(self) -> None:
        self.events.append(RewardReported(run_id=RUN, rollout_id=self.rollout_id, attempt_id="a1", value=1.0))
        self.events.append(RolloutStatusChanged(run_id=RUN, rollout_id=self.rollout_id, attempt_id="a1",
                                                status="succeeded"))  # fmt: skip

    def full(self) -> list[Event]:
        """The stream recorded in full (version 1): every call as it was, the missing ones absent."""
        return [e for e in self.events if e.event_id not in self.missing]

    def compact(self, unpack: bool = True) -> list[Event]:
        """The stream as a writer records it, through the wire: references and packed arrays
        (read back as lists, or with `unpack=False` as recorded).

        Each call references the earlier call with the longest shared prefix (the earliest among
        equals); a missing call is one the writer never remembered either, and the writer forgets
        all earlier calls there (a restart), so the next call is recorded in full.
        """
        remembered: list[tuple[str, list[int]]] = []
        out: list[Event] = []
        recorded: dict[str, Event] = {}
        for event in self.events:
            if not isinstance(event, ModelRequestRecorded):
                out.append(event)
                continue
            if event.event_id in recorded:  # re-sent: the same bytes again
                out.append(recorded[event.event_id])
                continue
            if event.event_id in self.missing:
                remembered.clear()
                continue
            ref: CallRef | None = None
            for event_id, tokens in remembered:
                shared = _shared(event.prompt_ids, tokens)
                if shared > (ref.tokens if ref else 0):
                    ref = CallRef(event_id=event_id, tokens=shared)
            new = event.prompt_ids[ref.tokens if ref else 0 :]
            recorded[event.event_id] = msgspec.structs.replace(
                event, prompt_ids=[], response_ids=[], logprobs=[], prompt_ref=ref or UNSET,
                packed=pack(new, event.response_ids, event.logprobs),
            )  # fmt: skip
            out.append(recorded[event.event_id])
            remembered.append((event.event_id, [*event.prompt_ids, *event.response_ids]))
        return [decode(encode(e), unpack=unpack) for e in out]


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def linear() -> History:
    h = History("linear")
    sequence = [1, 2, 3, 4]
    for turn in range(5):
        c = h.call(sequence, [10 + turn, 11 + turn])
        sequence = [*c.prompt_ids, *c.response_ids, 50 + turn]
    h.end()
    return h


def branching() -> History:
    """Two conversations of one attempt interleaved, a fork from a turn one of them has moved past, a
    re-encoded response (a reference to part of a call), and a fan-out of two identical calls whose
    continuation references the first (the comparison gives it to the second: equal chains, the later wins)."""
    h = History("branching")
    a = h.call([1, 2, 3, 7], [8])
    b = h.call([1, 2, 3, 9], [6])
    for turn in range(3):
        a = h.call([*a.prompt_ids, *a.response_ids, 20 + turn], [30 + turn])
        b = h.call([*b.prompt_ids, *b.response_ids, 40 + turn], [60 + turn, 61])
    first = next(e for e in h.events if isinstance(e, ModelRequestRecorded))
    h.call([*first.prompt_ids, *first.response_ids, 99], [98])  # references the first call, whose chain moved on
    h.call([*a.prompt_ids, *a.response_ids, 70], [71], temperature=0.5)  # same context, another temperature
    h.call([*b.prompt_ids, b.response_ids[0] + 500, *b.response_ids[1:], 77], [78])  # drift inside b's response
    fan = h.call([5, 5, 5], [6, 7])
    h.call(fan.prompt_ids, fan.response_ids, concurrent=True)
    h.call([*fan.prompt_ids, *fan.response_ids, 8], [9])
    h.end()
    return h


def retries() -> History:
    """A call retried with the same prompt (the retry's answer is continued) and an event on the stream twice."""
    h = History("retries")
    c = h.call([1, 2, 3], [4])
    tried = h.call([*c.prompt_ids, *c.response_ids, 5], [6, 6])
    retry = h.call(tried.prompt_ids, [7, 7])
    twice = h.call([*retry.prompt_ids, *retry.response_ids, 8], [9])
    h.again(twice)
    h.call([*twice.prompt_ids, *twice.response_ids, 10], [11])
    h.end()
    return h


def missing_base() -> History:
    """The call a prompt continues is not on the stream: the next call was recorded in full, then referenced."""
    h = History("missing")
    c = h.call([1, 2, 3], [4], missing=True)
    c = h.call([*c.prompt_ids, *c.response_ids, 5], [6])
    c = h.call([*c.prompt_ids, *c.response_ids, 7], [8])
    h.call([*c.prompt_ids, *c.response_ids, 9], [10])
    h.end()
    return h


def _samples(rollout: RolloutCalls, config: AdapterConfig) -> list[dict[str, object]]:
    merged, _ = merge_rollouts([rollout], config)
    return [plain(s) for m in merged for s in m.samples]


def _without_refs(rollout: RolloutCalls) -> RolloutCalls:
    calls = [msgspec.structs.replace(c, event_id=None, prompt_ref=None, ref_tokens=0) for c in rollout.calls]
    return msgspec.structs.replace(rollout, calls=calls)


@pytest.mark.parametrize("unpack", [True, False], ids=["lists", "packed"])
@pytest.mark.parametrize("history", [linear, branching, retries, missing_base])
def test_merging_through_references_equals_comparing(history: Callable[[], History], unpack: bool) -> None:
    h = history()
    compact, full = rollout_calls(h.compact(unpack)), rollout_calls(h.full())
    assert plain([c.prompt_ids for c in compact.calls]) == plain([c.prompt_ids for c in full.calls])
    assert plain([c.logprobs for c in compact.calls]) == plain([c.logprobs for c in full.calls])
    assert any(c.prompt_ref for c in compact.calls), "the compact history carries references"
    assert not any(c.prompt_ref for c in full.calls)
    for config in CONFIGS:
        expected = _samples(full, config)
        assert _samples(compact, config) == expected, config
        assert _samples(_without_refs(compact), config) == expected, config


def test_a_linear_conversation_is_one_sample_chained_by_references() -> None:
    rollout = rollout_calls(linear().compact())
    calls = rollout.calls
    assert calls[0].prompt_ref is None
    for earlier, call in pairwise(calls):
        assert (call.prompt_ref, call.ref_tokens) == (
            earlier.event_id,
            len(earlier.prompt_ids) + len(earlier.response_ids),
        )
    (sample,) = merge_calls(calls, rollout_id="linear", group_id="g").samples
    assert sample.call_ids == [c.call_id for c in calls]
    assert plain(sample.tokens) == [*plain(calls[-1].prompt_ids), *plain(calls[-1].response_ids)]


def test_a_conversations_prompts_are_slices_of_the_attempts_one_id_array() -> None:
    """Each turn's full prompt is the turn before it plus its new ids: read as one array, nothing is copied."""
    calls = rollout_calls(linear().compact(unpack=False)).calls
    assert len(calls) == 5
    assert all(np.shares_memory(call.prompt_ids, calls[-1].prompt_ids) for call in calls)
    assert all(np.shares_memory(call.response_ids, calls[-1].prompt_ids) for call in calls[:-1])
    forked = rollout_calls(branching().compact(unpack=False)).calls  # a fork or a partial reference builds its prompt
    assert not all(np.shares_memory(call.prompt_ids, forked[0].prompt_ids) for call in forked)


def test_an_event_recorded_twice_is_not_a_reference_target() -> None:
    rollout = rollout_calls(retries().compact())
    ids = [c.event_id for c in rollout.calls]
    repeated = [i for i in ids if i is not None and ids.count(i) > 1]
    assert not repeated, "the second copy of an event has no event id"
    assert ids.count(None) == 1
    last = rollout.calls[-1]
    assert last.prompt_ref is None, "a reference into an event id seen twice is ambiguous and dropped"


def test_the_referenced_chain_is_taken_without_comparing_its_tokens() -> None:
    """White box: a reference is trusted between its ends (only its length and end tokens are checked).

    `rollout_calls` sets references only from the recorded ones, which hold by construction; this
    pins that the merge uses them rather than comparing arrays.
    """
    rollout = rollout_calls(linear().compact())
    first, second = rollout.calls[:2]
    forged = [*second.prompt_ids]
    forged[1] += 1000  # inside the shared prefix
    calls = [first, msgspec.structs.replace(second, prompt_ids=forged)]
    assert len(merge_calls(calls, rollout_id="linear", group_id="g").samples) == 1
    compared = [first, msgspec.structs.replace(second, prompt_ids=forged, prompt_ref=None)]
    assert len(merge_calls(compared, rollout_id="linear", group_id="g").samples) == 2
