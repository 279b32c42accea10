"""Which calls and which reward of a rollout's event history become training data."""

from __future__ import annotations

import pytest

from schemas import (
    AttemptStarted,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
)
from trainer.core import (
    CallTokens,
    MalformedCall,
    NotTrainable,
    call_from_event,
    collect_rollouts,
    rollout_calls,
)

RUN = "run1"


def _call(rollout: str, attempt: str | None, call_id: str, prompt: list[int], **kw: object) -> ModelRequestRecorded:
    response = kw.pop("response", [7, 8])
    return ModelRequestRecorded(
        run_id=RUN,
        rollout_id=rollout,
        attempt_id=attempt,
        call_id=call_id,
        prompt_ids=prompt,
        response_ids=response,  # type: ignore[arg-type]
        logprobs=[-0.5] * len(response),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _status(rollout: str, attempt: str | None, status: str) -> RolloutStatusChanged:
    return RolloutStatusChanged(run_id=RUN, rollout_id=rollout, attempt_id=attempt, status=status)  # type: ignore[arg-type]


def _retried_rollout(rollout: str = "ro1") -> list[Event]:
    """Attempt a1 crashes after one call and a reward; attempt a2 succeeds."""
    return [
        RolloutCreated(run_id=RUN, rollout_id=rollout, group_id="task7"),
        _status(rollout, None, "queuing"),
        AttemptStarted(run_id=RUN, rollout_id=rollout, attempt_id="a1", sequence=1),
        _status(rollout, "a1", "running"),
        _call(rollout, "a1", "c-a1", [1, 2, 3]),
        RewardReported(run_id=RUN, rollout_id=rollout, attempt_id="a1", value=0.3),
        _status(rollout, "a1", "requeuing"),
        AttemptStarted(run_id=RUN, rollout_id=rollout, attempt_id="a2", sequence=2),
        _status(rollout, "a2", "running"),
        _call(rollout, "a2", "c1", [1, 2, 3], weights_version=4),
        _call(rollout, "a2", "c-failed", [1, 2, 3, 7, 8, 9], status="failed", response=[]),
        _call(rollout, "a2", "c-val", [5, 5], mode="val"),
        _call(rollout, "a2", "c2", [1, 2, 3, 7, 8, 9], weights_version=5),
        RewardReported(run_id=RUN, rollout_id=rollout, attempt_id="a2", value=0.5),
        RewardReported(run_id=RUN, rollout_id=rollout, attempt_id="a2", value=0.9),
        _status(rollout, "a2", "succeeded"),
    ]


def test_only_ok_train_calls_of_the_succeeded_attempt_in_order() -> None:
    rc = rollout_calls(_retried_rollout())
    assert [c.call_id for c in rc.calls] == ["c1", "c2"]
    assert [c.weights_version for c in rc.calls] == [4, 5]
    assert (rc.run_id, rc.rollout_id, rc.group_id, rc.attempt_id) == (RUN, "ro1", "task7", "a2")


def test_reward_is_the_last_one_of_the_succeeded_attempt() -> None:
    events = _retried_rollout()
    assert rollout_calls(events).reward == 0.9
    # A reward for an earlier attempt reported late does not count.
    late = RewardReported(run_id=RUN, rollout_id="ro1", attempt_id="a1", value=-1.0)
    assert rollout_calls([*events, late]).reward == 0.9
    # An evaluator's reward for the rollout as a whole (no attempt id) reported last does.
    evaluator = RewardReported(run_id=RUN, rollout_id="ro1", value=0.25, source="evaluator")
    assert rollout_calls([*events, evaluator]).reward == 0.25


def test_missing_reward_is_none() -> None:
    events = [e for e in _retried_rollout() if not (isinstance(e, RewardReported) and e.attempt_id == "a2")]
    assert rollout_calls(events).reward is None


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        ([e for e in _retried_rollout() if not isinstance(e, RolloutCreated)], "no-created-event"),
        (_retried_rollout()[:-1], "not-succeeded"),
        ([*_retried_rollout()[:-1], _status("ro1", "a2", "failed")], "not-succeeded"),
        (
            [RolloutCreated(run_id=RUN, rollout_id="ro1", mode="val"), *_retried_rollout()[1:]],
            "val-mode",
        ),
    ],
)
def test_rollouts_that_yield_no_training_data(events: list[Event], reason: str) -> None:
    with pytest.raises(NotTrainable) as info:
        rollout_calls(events)
    assert info.value.reason == reason


def test_collect_rollouts_splits_a_run_and_lists_skips() -> None:
    failed = [
        RolloutCreated(run_id=RUN, rollout_id="ro2", group_id="task7"),
        _status("ro2", None, "queuing"),
        _status("ro2", None, "failed"),
    ]
    interleaved = [e for pair in zip(_retried_rollout(), failed + [None] * 20, strict=False) for e in pair if e]
    collected = collect_rollouts(interleaved)
    assert [r.rollout_id for r in collected.rollouts] == ["ro1"]
    assert collected.skipped == {"ro2": "not-succeeded"}


def test_rollout_without_attempt_ids_matches_calls_without_one() -> None:
    events: list[Event] = [
        RolloutCreated(run_id=RUN, rollout_id="ro3", group_id="g"),
        _call("ro3", None, "c1", [4, 4]),
        RewardReported(run_id=RUN, rollout_id="ro3", value=1.0),
        _status("ro3", None, "succeeded"),
    ]
    rc = rollout_calls(events)
    assert [c.call_id for c in rc.calls] == ["c1"] and rc.reward == 1.0 and rc.attempt_id is None


def test_succeeded_without_attempt_id_falls_back_to_the_last_started_attempt() -> None:
    events = [*_retried_rollout()[:-1], _status("ro1", None, "succeeded")]
    rc = rollout_calls(events)
    assert rc.attempt_id == "a2" and [c.call_id for c in rc.calls] == ["c1", "c2"]


def test_mixed_rollouts_are_refused() -> None:
    with pytest.raises(ValueError, match="mixed"):
        rollout_calls([*_retried_rollout("ro1"), RolloutCreated(run_id=RUN, rollout_id="ro9")])


def test_untrainable_call_records_are_named() -> None:
    with pytest.raises(MalformedCall, match="no prompt token ids"):
        call_from_event(_call("ro1", "a1", "c1", []))
    with pytest.raises(MalformedCall, match="one logprob per sampled token"):
        CallTokens(call_id="c2", prompt_ids=[1], response_ids=[2, 3], logprobs=[-1.0]).check_trainable()
