"""The event contract: every type round-trips, bad input is refused naming the field, ids are subject-safe."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from schemas import (
    ENVELOPE_KEYS,
    EVENT_TYPES,
    SCHEMA_VERSION,
    AttemptStarted,
    CustomEvent,
    Event,
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
    to_dict,
)
from schemas.bounds import check_int
from schemas.export import JSON_DIR, stale_files
from schemas.ids import check_recurring_id
from schemas.refs import CallRef, pack
from schemas.runs import RunSpec
from schemas.transitions import IllegalTransition, check_transition

EXAMPLES = [
    RunStarted(run_id="r1", name="demo", spec=RunSpec(run_id="r1", command=["python", "a.py"], concurrency=2)),
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


def test_recurring_ids_are_remembered_only_when_valid_and_within_a_bound() -> None:
    """Event envelopes check run, rollout and attempt ids through a memo: a bad id is never let in."""
    from schemas import ids

    for _ in range(2):  # the second time, after the good ids of the first are remembered
        assert check_recurring_id("rollout_id", "ro-1") == "ro-1"
        with pytest.raises(InvalidId, match="rollout_id"):
            check_recurring_id("rollout_id", "ro.1")
        with pytest.raises(InvalidId):
            check_recurring_id("rollout_id", ["ro-1"])
        with pytest.raises(InvalidId, match="run_id"):
            RewardReported(run_id="bad.run", rollout_id="ro-1", value=1.0)
    assert "ro.1" not in ids._RECURRING
    for n in range(ids._RECURRING_MAX + 10):
        check_recurring_id("rollout_id", f"ro-{n}")
    assert 0 < len(ids._RECURRING) <= ids._RECURRING_MAX


def test_integer_bounds_refuse_bools_and_out_of_range_values() -> None:
    check_int("step", 7)
    check_int("step", None)
    for bad, message in ((True, "got `bool`"), (1.0, "got `float`"), (-1, ">= 0"), (2**31, "<= 2147483647")):
        with pytest.raises(msgspec.ValidationError, match=message):
            check_int("choice_index", bad, 0, optional=False)
    with pytest.raises(msgspec.ValidationError, match="got `NoneType`"):
        check_int("choice_index", None, 0, optional=False)


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


def _minimal(event_type: type[Event]) -> Event:
    """An event of the type with only its required fields set (every other field at its default)."""
    required: dict[str, Any] = {
        "call_id": "c1", "status": "running", "sequence": 1, "value": 1.0, "name": "n", "base_url": "http://h/v1",
        "phase": "update",
    }  # fmt: skip
    names = {f.name for f in msgspec.structs.fields(event_type) if f.required}
    return event_type(run_id="r1", rollout_id="ro1", **{k: v for k, v in required.items() if k in names})


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.__name__)
def test_fields_at_their_default_are_absent_but_the_envelope_is_always_there(event_type: type[Event]) -> None:
    event = _minimal(event_type)
    data = json.loads(encode(event))
    required = {f.name for f in msgspec.structs.fields(event_type) if f.required}
    assert set(data) == {*ENVELOPE_KEYS, "rollout_id", *required}
    assert data["schema_version"] == SCHEMA_VERSION == 5
    assert decode(encode(event)) == event == from_dict(data)
    assert set(to_dict(event)) == {"type", *event_type.__struct_fields__} - {
        f.name for f in msgspec.structs.fields(event_type) if f.default is msgspec.UNSET
    }


def test_a_packed_reference_call_carries_only_what_it_says() -> None:
    call = ModelRequestRecorded(
        run_id="r1", rollout_id="ro1", attempt_id="a1", call_id="c2", model="m", weights_version=1,
        finish_reason="stop", request={"messages": []}, usage={"prompt_tokens": 9}, latency_s=0.5,
        prompt_ref=CallRef(event_id="c1-0", seq=3, tokens=7, same=["model"]), packed=pack([8, 9], [10], [-0.5]),
    )  # fmt: skip
    data = json.loads(encode(call))
    assert list(data) == [
        "type", "run_id", "rollout_id", "attempt_id", "event_id", "schema_version", "time", "call_id", "model",
        "weights_version", "finish_reason", "request", "usage", "latency_s", "prompt_ref", "packed",
    ]  # fmt: skip
    assert decode(encode(call)) == msgspec.structs.replace(
        call, packed=msgspec.UNSET, prompt_ids=[8, 9], response_ids=[10], logprobs=[-0.5]
    )


def test_a_default_read_from_elsewhere_is_left_out_too() -> None:
    """msgspec knows a string or float default only by identity: the constructor puts the default object in."""
    train: Any = "".join(["tr", "ain"])  # equal to the defaults, other objects
    ok: Any = "".join(["o", "k"])
    call = ModelRequestRecorded(run_id="r1", rollout_id="r", call_id="c1", mode=train, status=ok, latency_s=float("0"))
    assert not {"mode", "status", "latency_s"} & json.loads(encode(call)).keys()
    created = RolloutCreated(run_id="r1", rollout_id="ro1", mode=train)
    assert "mode" not in json.loads(encode(created)) and decode(encode(created)) == created


@pytest.mark.parametrize("version", [1, 2, 3])
def test_events_recorded_with_every_field_explicit_still_decode(version: int) -> None:
    """Before version 4 every field was written, nulls and empty lists included: the same event."""
    call = ModelRequestRecorded(
        run_id="r1", rollout_id="ro1", attempt_id="a1", call_id="c1", schema_version=version,
        prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.25], request={"messages": []},
    )  # fmt: skip
    explicit = to_dict(call)
    if version >= 2:
        packed = msgspec.to_builtins(pack([1, 2], [3], [-0.25]))
        explicit.update(prompt_ids=[], response_ids=[], logprobs=[], packed=packed)
    if version < 3:
        for name in ("agent", "endpoint", "started_at", "temperature", "top_p", "top_k"):
            del explicit[name]
    assert decode(json.dumps(explicit)) == call == from_dict(explicit)
    assert json.loads(encode(call)).keys() < explicit.keys()


@pytest.mark.parametrize("event", [*EXAMPLES, *(_minimal(t) for t in EVENT_TYPES)], ids=lambda e: type(e).__name__)
def test_encoded_events_validate_against_the_committed_json_schemas(event: Event) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((JSON_DIR / f"{type(event).__struct_config__.tag}.json").read_text())
    data = json.loads(encode(event))
    jsonschema.validate(data, schema)
    for key in ENVELOPE_KEYS:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({k: v for k, v in data.items() if k != key}, schema)
