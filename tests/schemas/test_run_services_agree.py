"""The gateway, the controller and the projector agree on a run: each builds on the contract's run fold.

The history has two `RunStarted` of one run (a run's spec never changes, so the first one wins),
a model registered, re-registered and another removed, and two phase switches; it is delivered in
stream order and out of order with duplicates (a live feed overlapping a read, a gateway's own write
applied before another writer's older event). Only the services' event-applying parts run: none of
them reads the store or the network while applying, so no store is given.
"""

from __future__ import annotations

import random
from typing import Any, cast

import msgspec
import pytest

from schemas import ModelRegistered, ModelRemoved, PhaseChanged, RunStarted, encode
from schemas.events import Event
from schemas.runs import RunSpec
from services.common.eventstore import StoredEvent
from services.controller.reconciler import Controller
from services.controller.settings import ControllerSettings
from services.controller.view import RunSpecError
from services.gateway.errors import ApiError
from services.gateway.state import GatewayState
from services.projector.fold import Loaded, fold_batch
from services.projector.incoming import Incoming

RUN = "r1"
FIRST = RunSpec(run_id=RUN, concurrency=2, command=["python", "a.py"], model_aliases={"gpt": "policy"})
SECOND = RunSpec(run_id=RUN, concurrency=9, command=["python", "b.py"])


def _history() -> list[StoredEvent]:
    events: list[Event] = [
        ModelRegistered(run_id=RUN, name="policy", base_url="http://a/v1", weights_version=0),
        RunStarted(run_id=RUN, name="first", spec=FIRST),
        PhaseChanged(run_id=RUN, phase="update"),
        RunStarted(run_id=RUN, name="second", spec=SECOND),
        ModelRegistered(run_id=RUN, name="judge", base_url="http://j/v1"),
        ModelRemoved(run_id=RUN, name="judge"),
        ModelRegistered(run_id=RUN, name="policy", base_url="http://b/v1", weights_version=1),
        PhaseChanged(run_id=RUN, phase="rollout", weights_version=1),
    ]
    return [StoredEvent(seq=i, subject=e.subject, event=e) for i, e in enumerate(events, 1)]  # type: ignore[arg-type]


def _deliveries(seed: int) -> list[StoredEvent]:
    history = _history()
    rng = random.Random(seed)
    delivered = history + [rng.choice(history) for _ in range(5)]
    rng.shuffle(delivered)
    return delivered


def _gateway(delivered: list[StoredEvent]) -> tuple[Any, list[tuple[str, str]], Any]:
    state = GatewayState(cast(Any, None))
    for stored in delivered:
        state.apply(stored)
    models = [(m.name, m.base_url) for m in state.models_for(RUN, "none")]
    phase = state.phase(RUN)
    return state.spec(RUN), models, (phase.phase, phase.weights_version) if phase else None


def _controller(delivered: list[StoredEvent]) -> Any:
    settings = ControllerSettings(gateway_url="http://gateway", admin_token="t")
    controller = Controller(cast(Any, None), cast(Any, None), settings)
    for stored in delivered:
        if isinstance(stored.event, RunStarted):  # the controller reads only run specs of the run subjects
            controller._apply(stored)
    return controller.specs[RUN]


def _projector(delivered: list[StoredEvent]) -> tuple[Any, list[tuple[str, str]], Any]:
    items = [Incoming(s.seq, s.subject, encode(s.event), s.event.time, event=s.event) for s in delivered]
    plan = fold_batch(items, Loaded())
    run = plan.runs[RUN]
    live = [
        (name, m.base_url or "")
        for (_, name), m in sorted(plan.models.items())
        if m.registered_seq is not None and (m.removed_seq is None or m.removed_seq < m.registered_seq)
    ]
    return msgspec.json.decode(run.config or "null"), live, (run.phase, run.weights_version)


@pytest.mark.parametrize("seed", [None, *range(12)])
def test_gateway_controller_and_projector_agree(seed: int | None) -> None:
    delivered = _history() if seed is None else _deliveries(seed)
    gateway_spec, gateway_models, gateway_phase = _gateway(delivered)
    controller_spec = _controller(delivered)
    projector_spec, projector_models, projector_phase = _projector(delivered)
    assert gateway_spec == controller_spec == FIRST
    assert projector_spec == msgspec.to_builtins(FIRST)
    assert gateway_models == projector_models == [("policy", "http://b/v1")]
    assert gateway_phase == projector_phase == ("rollout", 1)


def test_an_invalid_stored_spec_is_surfaced_by_all_three_never_defaulted() -> None:
    """An older event's spec that no `RunSpec` reads: the gateway refuses the run's calls (409, the
    reason), the controller fails its rollouts with the reason, the projector shows it as recorded."""
    event = RunStarted(run_id=RUN, name="old", config={"backend": "docker", "budget": {"calls": 1}})
    delivered = [StoredEvent(seq=1, subject=event.subject, event=event)]
    state = GatewayState(cast(Any, None))
    state.apply(delivered[0])
    with pytest.raises(ApiError) as refused:
        state.spec(RUN)
    assert refused.value.status == 409 and "backend" in str(refused.value)
    controller_spec = _controller(delivered)
    assert isinstance(controller_spec, RunSpecError) and "backend" in controller_spec.message
    projector_spec, _, _ = _projector(delivered)
    assert projector_spec == {"backend": "docker", "budget": {"calls": 1}}
