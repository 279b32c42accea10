"""Multi-agent harnesses in the adapter: fan-outs are not retries, other models are context, failures score.

Each test here failed on the adapter before these rules (DESIGN §3): dedup took any identical
prompt for a retry, every `ok` call was trained (and one without token ids made the rollout
malformed), and a failed rollout always left its group.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from schemas import AttemptStarted, Event, ModelRequestRecorded, RewardReported, RolloutCreated, RolloutStatusChanged
from trainer.core import (
    AdapterConfig,
    NotTrainable,
    Selection,
    build_step,
    collect_rollouts,
    failure_kind,
    plain,
    rollout_calls,
)

RUN = "run1"


def _call(
    rollout: str, call_id: str, prompt: list[int], response: list[int], start: float, end: float, **kw: object
) -> ModelRequestRecorded:
    return ModelRequestRecorded(
        run_id=RUN,
        rollout_id=rollout,
        attempt_id="a1",
        call_id=call_id,
        prompt_ids=prompt,
        response_ids=response,
        logprobs=[-0.5] * len(response),
        time=end,
        latency_s=end - start,
        **kw,  # type: ignore[arg-type]
    )


def _rollout(
    rollout: str,
    calls: Sequence[Event],
    *,
    reward: float | None = 1.0,
    status: str = "succeeded",
    reason: str | None = None,
    group: str = "g",
    size: int | None = None,
) -> list[Event]:
    events: list[Event] = [
        RolloutCreated(run_id=RUN, rollout_id=rollout, group_id=group, metadata={"group_size": size} if size else {}),
        AttemptStarted(run_id=RUN, rollout_id=rollout, attempt_id="a1", sequence=1),
        RolloutStatusChanged(run_id=RUN, rollout_id=rollout, attempt_id="a1", status="running"),
        *calls,
    ]
    if reward is not None:
        events.append(RewardReported(run_id=RUN, rollout_id=rollout, attempt_id="a1", value=reward))
    events.append(
        RolloutStatusChanged(run_id=RUN, rollout_id=rollout, attempt_id="a1", status=status, reason=reason)  # type: ignore[arg-type]
    )
    return events


def test_a_concurrent_fan_out_of_one_prompt_keeps_every_answer() -> None:
    prompt = [1, 2, 3]
    calls: list[Event] = [
        _call("ro", "w1", prompt, [10, 11], 100.0, 103.0),  # three workers, started together
        _call("ro", "w2", prompt, [20], 100.1, 102.0),
        _call("ro", "w3", prompt, [30, 31, 32], 100.2, 104.0),
        _call("ro", "sum", [1, 2, 3, 10, 11, 5, 20, 5, 30, 31, 32, 6], [40], 105.0, 106.0),
    ]
    batch = build_step([rollout_calls(_rollout("ro", calls))], AdapterConfig())
    assert batch.stats.calls == 4 and batch.stats.calls_deduped == 0
    trained = sorted(cid for s in batch.samples for cid in s.call_ids)
    assert trained == ["sum", "w1", "w2", "w3"]
    # w1's sample is extended by the summary call; w2 and w3 stand alone
    assert sorted(len(s.call_ids) for s in batch.samples) == [1, 1, 2]


def test_a_sequential_retry_is_deduped_but_a_used_earlier_answer_is_not() -> None:
    prompt = [1, 2, 3]
    retried = [
        _call("ro", "try1", prompt, [7], 100.0, 101.0),  # ended, then the harness asked again
        _call("ro", "try2", prompt, [8], 102.0, 103.0),
        _call("ro", "next", [1, 2, 3, 8, 9], [4], 104.0, 105.0),
    ]
    batch = build_step([rollout_calls(_rollout("ro", retried))], AdapterConfig())
    assert batch.stats.calls_deduped == 1
    assert [s.call_ids for s in batch.samples] == [["try2", "next"]]
    used = [
        _call("ro", "first", prompt, [7], 100.0, 101.0),  # its answer is extended below: it was used
        _call("ro", "again", prompt, [8], 102.0, 103.0),
        _call("ro", "next", [1, 2, 3, 7, 9], [4], 104.0, 105.0),
    ]
    batch = build_step([rollout_calls(_rollout("ro", used))], AdapterConfig())
    assert batch.stats.calls_deduped == 0
    assert sorted(s.call_ids for s in batch.samples) == [["again"], ["first", "next"]]


def test_a_sequential_retry_with_the_same_answer_is_trained_once() -> None:
    """Both answers are extended by the next call, so neither looked like a retry: one sample now."""
    prompt = [1, 2, 3]
    same = [
        _call("ro", "try1", prompt, [7], 100.0, 101.0),
        _call("ro", "try2", prompt, [7], 102.0, 103.0),  # asked again after try1 ended; the same answer
        _call("ro", "next", [1, 2, 3, 7, 9], [4], 104.0, 105.0),
    ]
    batch = build_step([rollout_calls(_rollout("ro", same))], AdapterConfig())
    assert batch.stats.calls_deduped == 1
    assert [s.call_ids for s in batch.samples] == [["try2", "next"]]
    fan_out = [  # the same answers from a concurrent fan-out stay: each worker's answer counts
        _call("ro", "w1", prompt, [7], 100.0, 101.0),
        _call("ro", "w2", prompt, [7], 100.5, 101.5),
    ]
    batch = build_step([rollout_calls(_rollout("ro", fan_out))], AdapterConfig())
    assert batch.stats.calls_deduped == 0 and sorted(s.call_ids for s in batch.samples) == [["w1"], ["w2"]]


def test_calls_to_models_the_run_does_not_train_are_context_never_fatal() -> None:
    calls: list[Event] = [
        _call("ro", "c1", [1, 2], [3, 4], 1.0, 2.0, endpoint="policy", agent="writer"),
        # an external judge: no token ids at all
        ModelRequestRecorded(
            run_id=RUN,
            rollout_id="ro",
            attempt_id="a1",
            call_id="judge",
            model="gpt-x",
            endpoint="judge",
            time=3.0,
            latency_s=1.0,
        ),
        _call("ro", "frozen", [1, 2, 3, 4, 5], [6], 4.0, 5.0, endpoint="checker", agent="checker"),
        _call("ro", "c2", [1, 2, 3, 4, 5, 6, 7], [8], 6.0, 7.0, endpoint="policy", agent="writer"),
    ]
    config = AdapterConfig(models=("policy",))
    rc = rollout_calls(_rollout("ro", calls), config.selection())
    assert [c.call_id for c in rc.calls] == ["c1", "c2"]
    assert [c.call_id for c in rc.context] == ["judge", "frozen"]
    batch = build_step([rc], config)
    (sample,) = batch.samples
    assert sample.call_ids == ["c1", "c2"] and batch.stats.calls_context == 2
    # the checker's answer (token 6) is an observation: mask 0
    assert plain(sample.tokens) == [1, 2, 3, 4, 5, 6, 7, 8] and plain(sample.loss_mask) == [0, 0, 1, 1, 0, 0, 0, 1]
    # by agent name as well
    rc_agents = rollout_calls(_rollout("ro", calls), Selection(agents=("writer",)))
    assert [c.call_id for c in rc_agents.calls] == ["c1", "c2"]


@pytest.mark.parametrize(
    ("reason", "finish", "kind"),
    [
        ("timed out after 5s (stopped by the controller) (gave up after 1 of 1 attempt(s))", None, "timeout"),
        ("DeadlineExceeded: the attempt ran longer than its 60s timeout", None, "timeout"),
        ("agent exited with code 3\nlast lines of the log:\nTraceback", None, "agent-error"),
        ("agent exited with code 1", "length", "length"),
        ("ImagePullBackOff: Back-off pulling image 'x'", None, "infrastructure"),
        ("Evicted from node-1: The node was low on resource", None, "infrastructure"),
        ("DeadlineExceeded: ...; the pod never started: ErrImagePull", None, "infrastructure"),
        (None, None, None),
    ],
)
def test_failure_kinds(reason: str | None, finish: str | None, kind: str | None) -> None:
    assert failure_kind("failed", reason, finish) == kind


def test_a_timed_out_rollout_scores_in_its_group_and_an_image_pull_failure_is_dropped() -> None:
    def ok(rollout: str, reward: float, group: str = "g") -> list[Event]:
        calls: list[Event] = [_call(rollout, f"{rollout}-c", [1, 2], [3], 1.0, 2.0)]
        return _rollout(rollout, calls, reward=reward, group=group, size=4 if group == "g" else 2)

    events = [
        *ok("r0", 1.0),
        *ok("r1", 1.0),
        *_rollout(
            "r2",
            [_call("r2", "r2-c", [1, 2], [3], 1.0, 2.0)],
            reward=None,
            status="failed",
            reason="timed out after 5s (stopped by the controller)",
            size=4,
        ),
        *_rollout("r3", [], reward=None, status="failed", reason="ImagePullBackOff: Back-off pulling image", size=4),
        # a group whose only other rollout never started: left with one, skipped
        *ok("s0", 1.0, "lone"),
        *_rollout("s1", [], reward=None, status="failed", reason="Evicted from n1: low memory", group="lone", size=2),
    ]
    collected = collect_rollouts(events)
    assert collected.skipped == {"r3": "infrastructure", "s1": "infrastructure"}
    batch = build_step(collected.rollouts, AdapterConfig(failed_reward=-0.5))
    assert batch.stats.group_baselines == {"g": pytest.approx((1.0 + 1.0 - 0.5) / 3)}
    assert batch.stats.rollouts_failed_scored == 1 and batch.stats.groups_skipped == 1
    assert batch.stats.rollouts_in_skipped_groups == 1
    advantages = {s.rollout_id: s.advantage for s in batch.samples}
    assert advantages["r2"] == pytest.approx(-0.5 - 0.5) and "s0" not in advantages
    dropped = build_step(collected.rollouts, AdapterConfig(failed_reward="drop"))
    assert dropped.stats.rollouts_failed_dropped == 1 and dropped.stats.group_baselines == {"g": 1.0}


def _failed_with(cause: str | None, reason: str, last_call: ModelRequestRecorded) -> list[Event]:
    events = _rollout("ro", [_call("ro", "c1", [1, 2], [3], 1.0, 2.0), last_call], reward=None, status="failed")
    final = events[-1]
    assert isinstance(final, RolloutStatusChanged)
    return [*events[:-1], msgspec.structs.replace(final, reason=reason, cause=cause)]  # type: ignore[type-var]


def _failed_call(error: str) -> ModelRequestRecorded:
    """A call the gateway recorded as failed, its error worded as the gateway words it (gateway/pipeline.py)."""
    return ModelRequestRecorded(run_id=RUN, rollout_id="ro", attempt_id="a1", call_id="c2", status="failed",
                                error=error, time=3.0, latency_s=0.5)  # fmt: skip


@pytest.mark.parametrize(
    ("cause", "reason", "error", "kind"),
    [
        # the controller's cause decides, whatever the reason quotes from the agent's log
        ("agent-error", "exit code 3 in container 'agent': Evicted", "HTTP 400: prompt too long", "agent-error"),
        ("infrastructure", "evaluator exited with code 1", "HTTP 400: bad", "infrastructure"),
        ("timeout", "timed out after 9s", "HTTP 400: bad", "timeout"),
        # the agent exited because the engine was down: its last call failed at the endpoint
        ("agent-error", "agent exited with code 1", "the model endpoint failed: ConnectError()", "infrastructure"),
        ("agent-error", "agent exited with code 1", "HTTP 503: engine unavailable", "infrastructure"),
        # events without a cause: only the controller's words count, not the log excerpt after them
        (None, "agent exited with code 3\nlast lines of the log:\nEvicted: OOMKilled", "HTTP 400: x", "agent-error"),
    ],
)
def test_the_failure_kind_comes_from_the_controllers_cause_and_the_recorded_calls(
    cause: str | None, reason: str, error: str, kind: str
) -> None:
    events = _failed_with(cause, reason, _failed_call(error))
    if kind == "infrastructure":
        with pytest.raises(NotTrainable, match="infrastructure"):
            rollout_calls(events)
    else:
        assert rollout_calls(events).failure == kind
