"""The contract's run fold (`schemas.run`): the spec typed on `RunStarted`, older events still read,
the first `RunStarted` wins, and the view is the same whatever the delivery order and duplicates."""

from __future__ import annotations

import random

import msgspec
import pytest

from schemas import MalformedEvent, ModelRegistered, ModelRemoved, PhaseChanged, RunStarted, decode, encode
from schemas.events import Event
from schemas.run import InvalidRunSpec, RunView, fold, fold_all, spec_of
from schemas.runs import AttemptBudget, RunSpec
from services.common.eventstore import StoredEvent

RUN = "r1"


def stored(seq: int, event: Event) -> StoredEvent:
    return StoredEvent(seq=seq, subject=event.subject, event=event)  # type: ignore[arg-type]


def test_run_started_carries_a_typed_spec_and_round_trips() -> None:
    spec = RunSpec(run_id=RUN, concurrency=3, budget=AttemptBudget(calls=5), model_aliases={"a": "policy"})
    event = RunStarted(run_id=RUN, spec=spec)
    again = decode(encode(event))
    assert isinstance(again, RunStarted) and again.spec == spec and spec_of(again) is again.spec


def test_an_older_event_with_a_config_mapping_still_decodes() -> None:
    """Written by schema version 4: the spec as a plain `config` mapping, without `spec`."""
    old = b'{"type":"run.started","event_id":"e1","schema_version":4,"run_id":"r1","time":1.0,"name":"n",'
    old += b'"config":{"run_id":"r1","command":["python","a.py"],"concurrency":4,"budget":{"calls":2}}}'
    event = decode(old)
    assert isinstance(event, RunStarted) and event.spec is None
    spec = spec_of(event)
    assert spec.concurrency == 4 and spec.budget.calls == 2 and spec.command == ["python", "a.py"]


def test_an_invalid_spec_is_refused_on_decode_or_surfaced_by_the_fold() -> None:
    bad_new = b'{"type":"run.started","event_id":"e1","schema_version":5,"run_id":"r1","time":1.0,'
    bad_new += b'"spec":{"run_id":"r1","backend":"docker"}}'
    with pytest.raises(MalformedEvent, match="backend"):
        decode(bad_new)
    with pytest.raises(msgspec.ValidationError, match=r"spec\.run_id"):
        RunStarted(run_id="r2", spec=RunSpec(run_id=RUN))
    with pytest.raises(MalformedEvent, match=r"spec\.run_id"):
        decode(
            bad_new.replace(b'"backend":"docker"', b'"backend":"local"').replace(
                b'"run_id":"r1","time"', b'"run_id":"r2","time"'
            )
        )
    old = RunStarted(run_id=RUN, config={"backend": "docker"})
    with pytest.raises(InvalidRunSpec, match="backend"):
        spec_of(old)
    view = fold(None, stored(1, old))
    assert view is not None and view.started and view.spec is None and "backend" in (view.spec_error or "")


def _history() -> list[StoredEvent]:
    first = RunSpec(run_id=RUN, concurrency=2)
    return [
        stored(1, ModelRegistered(run_id=RUN, name="policy", base_url="http://a/v1/", weights_version=0)),
        stored(2, RunStarted(run_id=RUN, name="first", spec=first)),
        stored(3, PhaseChanged(run_id=RUN, phase="update")),
        stored(4, RunStarted(run_id=RUN, name="second", spec=RunSpec(run_id=RUN, concurrency=9))),
        stored(5, ModelRegistered(run_id=RUN, name="judge", base_url="http://j/v1")),
        stored(6, ModelRemoved(run_id=RUN, name="judge")),
        stored(7, ModelRegistered(run_id=RUN, name="policy", base_url="http://b/v1", weights_version=1)),
        stored(8, PhaseChanged(run_id=RUN, phase="rollout", weights_version=1)),
    ]


def test_the_first_run_started_wins_and_the_last_registration_and_phase() -> None:
    view = fold_all(_history())[RUN]
    assert view.spec is not None and view.spec.concurrency == 2 and view.name == "first" and view.started_seq == 2
    assert [m.name for m in view.live_models()] == ["policy"]
    policy = view.models["policy"]
    assert policy.base_url == "http://b/v1" and policy.weights_version == 1 and policy.seq == 7
    assert view.models["judge"].removed_seq == 6 and not view.models["judge"].live
    assert view.phase is not None and view.phase.phase == "rollout" and view.phase.seq == 8
    assert view.last_seq == 8


@pytest.mark.parametrize("shuffle_seed", range(20))
def test_any_delivery_order_with_duplicates_gives_the_stream_order_view(shuffle_seed: int) -> None:
    history = _history()
    expected = fold_all(history)[RUN]
    rng = random.Random(shuffle_seed)
    delivered = history + [rng.choice(history) for _ in range(6)]
    rng.shuffle(delivered)
    view: RunView | None = None
    for item in delivered:
        view = fold(view, item)
    assert view == expected
    assert fold(view, history[3]) is view  # a duplicate changes nothing, not even the object


def test_other_events_and_other_runs_change_nothing() -> None:
    view = fold_all(_history())[RUN]
    other = stored(9, RunStarted(run_id="r2", spec=RunSpec(run_id="r2")))
    assert fold(view, other) is view
    assert fold(None, stored(1, PhaseChanged(run_id=RUN, phase="update"))) is not None
    assert msgspec.json.decode(msgspec.json.encode(view), type=RunView) == view
