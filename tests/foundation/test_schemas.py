"""The event contract: every type round-trips, bad input is refused naming the field, ids are subject-safe."""

from __future__ import annotations

import json

import pytest

from schemas import (
    AttemptStarted,
    CustomEvent,
    InvalidId,
    MalformedEvent,
    ModelRegistered,
    ModelRemoved,
    ModelRequestRecorded,
    PhaseChanged,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    RunStarted,
    check_id,
    decode,
    encode,
    from_dict,
)
from schemas.export import stale_files
from schemas.transitions import IllegalTransition, check_transition

EXAMPLES = [
    RunStarted(run_id="r1", name="demo", config={"backend": "local"}),
    RolloutCreated(run_id="r1", rollout_id="ro1", input={"q": "2+2"}, group_id="task-7", metadata={"k": 1}),
    RolloutStatusChanged(
        run_id="r1", rollout_id="ro1", attempt_id="a1", status="failed", previous="running", reason="exit code 3"
    ),
    AttemptStarted(run_id="r1", rollout_id="ro1", attempt_id="a1", sequence=1, executor="local"),
    ModelRequestRecorded(
        run_id="r1",
        rollout_id="ro1",
        attempt_id="a1",
        call_id="c1",
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        logprobs=[-0.1, -2.5],
        finish_reason="stop",
        weights_version=3,
        request={"messages": [{"role": "user", "content": "hi"}]},
        usage={"prompt_tokens": 3},
    ),
    RewardReported(run_id="r1", rollout_id="ro1", attempt_id="a1", value=0.5, name="pass", source="evaluator"),
    CustomEvent(run_id="r1", rollout_id="ro1", attempt_id="a1", name="log", payload={"path": "x.log"}),
    ModelRegistered(run_id="r1", name="policy", base_url="http://127.0.0.1:9000/v1", weights_version=0),
    ModelRemoved(run_id="r1", name="policy"),
    PhaseChanged(run_id="r1", phase="update", weights_version=4),
]

SUBJECTS = [
    "rl.r1.run",
    "rl.r1.rollout.ro1.created",
    "rl.r1.rollout.ro1.status",
    "rl.r1.rollout.ro1.attempt",
    "rl.r1.rollout.ro1.model_request",
    "rl.r1.rollout.ro1.reward",
    "rl.r1.rollout.ro1.event.log",
    "rl.r1.model.policy",
    "rl.r1.model.policy",
    "rl.r1.phase",
]


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_type_round_trips(event: object) -> None:
    data = encode(event)  # type: ignore[arg-type]
    assert decode(data) == event
    assert from_dict(json.loads(data)) == event
    assert json.loads(data)["type"] == type(event).__struct_config__.tag  # type: ignore[attr-defined]


def test_subjects_follow_the_contract() -> None:
    assert [e.subject for e in EXAMPLES] == SUBJECTS


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"type": "reward", "run_id": "r1", "rollout_id": "x", "value": "high"}, "$.value"),
        (
            {"type": "model_request", "run_id": "r1", "rollout_id": "x", "call_id": "c", "prompt_ids": [1, "2"]},
            "$.prompt_ids[1]",
        ),
        ({"type": "rollout.status", "run_id": "r1", "rollout_id": "x", "status": "flying"}, "$.status"),
        ({"type": "reward", "rollout_id": "x", "value": 1.0}, "run_id"),
        ({"type": "nonsense", "run_id": "r1"}, "type"),
    ],
)
def test_malformed_input_names_the_field(payload: dict[str, object], field: str) -> None:
    with pytest.raises(MalformedEvent, match=field.replace("$", r"\$").replace("[", r"\[").replace("]", r"\]")):
        from_dict(payload)
    with pytest.raises(MalformedEvent):
        decode(json.dumps(payload))


def test_not_json_is_malformed() -> None:
    with pytest.raises(MalformedEvent):
        decode(b"{not json")


@pytest.mark.parametrize("bad", ["", "a.b", "a*", "a>", "a b", "tab\t", "x" * 129, "a/b"])
def test_unsafe_ids_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidId):
        check_id("rollout_id", bad)
    with pytest.raises((InvalidId, MalformedEvent)):
        from_dict({"type": "reward", "run_id": "r1", "rollout_id": bad, "value": 1.0})


def test_ids_at_the_limit_are_accepted() -> None:
    assert check_id("run_id", "x" * 128) == "x" * 128
    assert check_id("run_id", "Run_42-ok:v1") == "Run_42-ok:v1"


def test_unsafe_id_in_constructor_fails_loudly() -> None:
    with pytest.raises(InvalidId, match="run_id"):
        RewardReported(run_id="bad.run", rollout_id="x", value=1.0)


def test_transition_table() -> None:
    check_transition(None, "queuing")
    check_transition("queuing", "preparing")
    check_transition("running", "requeuing")
    for terminal in ("succeeded", "failed", "cancelled"):
        with pytest.raises(IllegalTransition, match="terminal"):
            check_transition(terminal, "running")
    with pytest.raises(IllegalTransition, match="allowed next"):
        check_transition("queuing", "succeeded")


def test_committed_json_schemas_are_current() -> None:
    assert stale_files() == [], "run `rollwire schemas export` and commit schemas/json"
