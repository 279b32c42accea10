"""Property: the projector's per-rollout sample count is the trainer's dedup + merge, on random histories.

The projector counts samples one call at a time without keeping tokens (`services/projector/chains.py`);
the trainer reads the rollout's calls whole (`rollout_calls`), drops retries (`dedup_calls`) and
merges the rest into samples (`merge_calls`). On any history of one attempt whose calls run one
after another (a new conversation, the next turn of any earlier call, a retry of any earlier
prompt, an answer that repeats), recorded in full, as a reference to an earlier call, packed or not,
both must give the same number. Everything runs through the real decoders: the projector's
`prepare_one` (with its reference cache) and `fold_batch`, and the trainer's `schemas.calls`
records. The seed is pinned (`@seed`), so a failure replays exactly.
"""

from __future__ import annotations

from hypothesis import given, seed, settings
from hypothesis import strategies as st

from schemas import (
    AnyEvent,
    AttemptStarted,
    CallRef,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    encode,
)
from schemas.calls import decode_call
from schemas.refs import pack
from services.projector.fold import Loaded, fold_batch
from services.projector.incoming import prepare_one
from services.projector.refs import RefCache
from trainer.core import dedup_calls, merge_calls, rollout_calls

RUN, RID, AID = "r1", "ro1", "a1"
_tokens = st.lists(st.integers(1, 50), min_size=1, max_size=4)


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[list[int], list[int], bool, bool]]:
    """Calls of one attempt, in order: (prompt, response, recorded as a reference, packed)."""
    calls: list[tuple[list[int], list[int], bool, bool]] = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["new", "turn", "retry", "repeat"] if calls else ["new"]))
        if kind == "new":
            prompt = draw(_tokens)
        else:
            prompt0, response0, _, _ = calls[draw(st.integers(0, len(calls) - 1))]
            prompt = [*prompt0, *response0, *draw(_tokens)] if kind == "turn" else prompt0
        response = calls[-1][1] if kind == "repeat" and prompt == calls[-1][0] else draw(_tokens)
        calls.append((prompt, response, kind == "turn" and draw(st.booleans()), draw(st.booleans())))
    return calls


def _events(history: list[tuple[list[int], list[int], bool, bool]]) -> list[AnyEvent]:
    t = 1000.0
    events: list[AnyEvent] = [
        RolloutCreated(run_id=RUN, rollout_id=RID, input={}, time=t),
        RolloutStatusChanged(run_id=RUN, rollout_id=RID, status="queuing", time=t),
        AttemptStarted(run_id=RUN, rollout_id=RID, attempt_id=AID, sequence=1, time=t),
        RolloutStatusChanged(run_id=RUN, rollout_id=RID, attempt_id=AID, status="running", previous="queuing", time=t),
    ]
    recorded: list[tuple[str, list[int]]] = []  # (event id, prompt + response) of each call so far
    for i, (prompt, response, as_ref, packed) in enumerate(history):
        t += 1.0
        ref = next((r for r in reversed(recorded) if as_ref and prompt[: len(r[1])] == r[1]), None)
        stored = prompt[len(ref[1]) :] if ref else prompt
        logprobs = [-0.5] * len(response)
        fields: dict[str, object] = (
            {"packed": pack(stored, response, logprobs)}
            if packed
            else {"prompt_ids": stored, "response_ids": response, "logprobs": logprobs}
        )
        call = ModelRequestRecorded(
            run_id=RUN,
            rollout_id=RID,
            attempt_id=AID,
            event_id=f"e{i}",
            call_id=f"c{i}",
            started_at=t - 0.5,
            time=t,
            prompt_ref=CallRef(event_id=ref[0], tokens=len(ref[1])) if ref else None,
            **fields,  # type: ignore[arg-type]
        )
        events.append(call)
        recorded.append((call.event_id, [*prompt, *response]))
    t += 1.0
    events.append(RewardReported(run_id=RUN, rollout_id=RID, attempt_id=AID, value=1.0, time=t))
    events.append(
        RolloutStatusChanged(run_id=RUN, rollout_id=RID, attempt_id=AID, status="succeeded", previous="running", time=t)
    )
    return events


def _projector_count(events: list[AnyEvent]) -> int:
    refs = RefCache()
    items = [prepare_one(seq, e.subject, encode(e), 0.0, None, None, refs) for seq, e in enumerate(events, start=1)]
    assert not [item.error for item in items if item.error]
    plan = fold_batch(items, Loaded())
    return sum(delta.samples for key, delta in plan.stats.items() if key[:2] == (RUN, RID))


def _trainer_count(events: list[AnyEvent]) -> int:
    history = [decode_call(encode(e)) if isinstance(e, ModelRequestRecorded) else e for e in events]
    rollout = rollout_calls(history)
    calls = dedup_calls(rollout.calls, rollout.context)
    return len(merge_calls(calls, rollout_id=RID, group_id=None).samples)


@seed(20261204)
@settings(max_examples=300, deadline=None, derandomize=True)
@given(history=histories())
def test_projector_counts_the_samples_the_trainer_makes(history: list[tuple[list[int], list[int], bool, bool]]) -> None:
    events = _events(history)
    assert _projector_count(events) == _trainer_count(events)
