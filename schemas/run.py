"""What the events mean for one run: its spec, its models and its phase, as a pure fold.

    view = None
    for stored in store.read(["rl.<run>.run", "rl.<run>.model.*", "rl.<run>.phase"]):
        view = fold(view, stored)               # a RunView from the run's first run event on

Every service that needs a run uses this one fold: the gateway (the spec each call is checked
against, the endpoints it may use, the phase), the controller (how the run's rollouts execute)
and the projector (the `runs` and `models` rows). The rules, once:

- **The first `RunStarted` (the lowest stream sequence) wins.** A run's spec never changes (the
  registry refuses a different one with a 409), so a later `RunStarted` of the run changes nothing.
- **A stored spec that is not a valid `RunSpec` is surfaced, never defaulted:** the view has no
  `spec` and `spec_error` says why; each reader refuses to act on the run with that message.
  (A new spec is refused where it enters, by the registry, with a 422.)
- **Idempotent by stream sequence, whatever the delivery order:** each part of the view keeps the
  sequence of the event it came from (the spec, each model name's registration and removal, the
  phase), and an event at or below it (above it, for the spec) changes nothing. A replay over a
  view, a duplicate, a live feed that overlaps a read, or a gateway's own write applied before
  another writer's older event arrives: each gives the view that stream order gives.
- The last registration of a model name wins; a removal after it takes the model out of `live`.
  The last phase wins.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from schemas.events import ModelRegistered, ModelRemoved, PhaseChanged, RunStarted
from schemas.ids import InvalidId
from schemas.rollout import Sequenced
from schemas.runs import RunSpec


class InvalidRunSpec(ValueError):
    """A stored run spec that is not a valid `RunSpec`; the message names the run and the field."""


def spec_of(event: RunStarted) -> RunSpec:
    """The event's run spec: `spec`, or an older event's `config` mapping (its run id from the envelope).

    Raises InvalidRunSpec when an older event's mapping is not a valid spec (a newer event with an
    invalid spec does not decode at all)."""
    if event.spec is not None:
        return event.spec
    try:
        return msgspec.convert({**event.config, "run_id": event.run_id}, RunSpec)
    except (msgspec.ValidationError, InvalidId) as exc:
        raise InvalidRunSpec(f"run {event.run_id} has an invalid spec: {exc}") from None


class ModelView(msgspec.Struct, frozen=True, kw_only=True):
    """One model name of a run: its last registration, and its last removal (if any)."""

    run_id: str
    name: str
    base_url: str = ""
    """The endpoint's base URL, without a trailing slash."""
    served_model: str | None = None
    weights_version: int | None = None
    api_key: str | None = None
    tokenizer: str | None = None
    reasoning_parser: str | None = None
    adapters: dict[str, str] = {}
    seq: int = 0
    """The stream sequence of its last registration (0: removed without a registration in view)."""
    registered_at: float | None = None
    removed_seq: int | None = None
    removed_at: float | None = None

    @property
    def live(self) -> bool:
        """Registered, and not removed since."""
        return self.seq > 0 and (self.removed_seq is None or self.removed_seq < self.seq)

    @property
    def upstream_model(self) -> str:
        """The model name to send upstream."""
        return self.served_model or self.name

    def for_agent(self, agent: str | None) -> ModelView:
        """This model as the agent's calls use it: `served_model` is the agent's adapter when it has one."""
        adapter = self.adapters.get(agent) if agent is not None else None
        return self if adapter is None else msgspec.structs.replace(self, served_model=adapter)


class PhaseView(msgspec.Struct, frozen=True, kw_only=True):
    """The run's last phase (collocated async: `update` holds new calls)."""

    phase: str
    weights_version: int | None
    seq: int
    time: float


class RunView(msgspec.Struct, frozen=True, kw_only=True):
    """A run's state: its spec (from its first `RunStarted`), its models and its phase."""

    run_id: str
    name: str = ""
    spec: RunSpec | None = None
    spec_error: str | None = None
    invalid_config: dict[str, Any] = {}
    """An invalid older spec's mapping, as recorded (what a reader shows beside `spec_error`)."""
    started_seq: int | None = None
    started_at: float | None = None
    models: dict[str, ModelView] = {}
    phase: PhaseView | None = None
    last_seq: int = 0

    @property
    def started(self) -> bool:
        """A `RunStarted` was folded (its spec valid or not)."""
        return self.started_seq is not None

    def recorded_spec(self) -> dict[str, Any] | None:
        """The spec as a JSON-ready mapping (an invalid older one as recorded); None before `RunStarted`."""
        if self.spec is not None:
            return msgspec.to_builtins(self.spec)
        return dict(self.invalid_config) if self.started else None

    def live_models(self) -> list[ModelView]:
        """The run's registered, not removed, models in name order."""
        return [m for _, m in sorted(self.models.items()) if m.live]


def fold(view: RunView | None, stored: Sequenced) -> RunView | None:
    """The run's state after `stored` (a run, model or phase event of the run; others change nothing).

    Returns `view` itself when the event changes nothing: a duplicate, an event older than the part
    it would change, another run's event, another kind of event."""
    event = stored.event
    seq = stored.seq
    if view is not None and event.run_id != view.run_id:
        return view
    base = view if view is not None else RunView(run_id=event.run_id)
    match event:
        case RunStarted():
            if base.started_seq is not None and base.started_seq <= seq:
                return view if view is not None else base
            folded = _started(base, event, seq)
        case ModelRegistered():
            old = base.models.get(event.name)
            if old is not None and seq <= old.seq:
                return view if view is not None else base
            folded = _with_model(base, _registered(old, event, seq))
        case ModelRemoved():
            old = base.models.get(event.name) or ModelView(run_id=event.run_id, name=event.name)
            if seq <= (old.removed_seq or 0):
                return view if view is not None else base
            folded = _with_model(base, msgspec.structs.replace(old, removed_seq=seq, removed_at=event.time))
        case PhaseChanged():
            if base.phase is not None and seq <= base.phase.seq:
                return view if view is not None else base
            phase = PhaseView(phase=event.phase, weights_version=event.weights_version, seq=seq, time=event.time)
            folded = msgspec.structs.replace(base, phase=phase)
        case _:
            return view
    return msgspec.structs.replace(folded, last_seq=max(base.last_seq, seq))


def _with_model(base: RunView, model: ModelView) -> RunView:
    return msgspec.structs.replace(base, models={**base.models, model.name: model})


def _started(base: RunView, event: RunStarted, seq: int) -> RunView:
    spec: RunSpec | None = None
    error: str | None = None
    try:
        spec = spec_of(event)
    except InvalidRunSpec as exc:
        error = str(exc)
    return msgspec.structs.replace(
        base,
        name=event.name,
        spec=spec,
        spec_error=error,
        invalid_config={} if spec is not None else dict(event.config),
        started_seq=seq,
        started_at=event.time,
    )


def _registered(old: ModelView | None, event: ModelRegistered, seq: int) -> ModelView:
    return ModelView(
        run_id=event.run_id,
        name=event.name,
        base_url=event.base_url.rstrip("/"),
        served_model=event.served_model,
        weights_version=event.weights_version,
        api_key=event.api_key,
        tokenizer=event.tokenizer or None,
        reasoning_parser=event.reasoning_parser or None,
        adapters=dict(event.adapters),
        seq=seq,
        registered_at=event.time,
        removed_seq=old.removed_seq if old is not None else None,
        removed_at=old.removed_at if old is not None else None,
    )


def fold_all(stored: Iterable[Sequenced]) -> dict[str, RunView]:
    """Each run's view after every event of `stored` (an iterable of sequenced events, any runs)."""
    views: dict[str, RunView] = {}
    for item in stored:
        folded = fold(views.get(item.event.run_id), item)
        if folded is not None:
            views[item.event.run_id] = folded
    return views
