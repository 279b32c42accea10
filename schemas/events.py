"""The event contract: every fact Rollwire knows is one of these frozen, tagged msgspec Structs.

All events share one envelope (the fields of `Event`): `event_id` (also the JetStream message id,
so a re-sent event is a duplicate, not a second fact), `type` (the tag), `schema_version`,
`run_id`, `rollout_id`, `attempt_id` and `time` (Unix seconds). Each event type adds its own
fields. Evolution is additive: new fields get defaults, no field ever changes type, and
`schema_version` says which revision wrote the event.

Events are named for what happened. They are encoded as flat JSON objects with a `"type"` key,
so a monitor in any language can read them. Since version 4 a field whose value is its default is
left out of the JSON (absent means the default: `null`, `[]`, `{}`, `0`, `"ok"`, ...); the envelope
keys `type`, `event_id`, `schema_version`, `run_id` and `time` are always written (`ENVELOPE_KEYS`).
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

import msgspec
from msgspec import UNSET, UnsetType

from schemas.bounds import Count, Int32, Positive, check_int
from schemas.ids import (
    CUSTOM_EVENT,
    MODEL,
    MODEL_REQUEST,
    PHASE,
    REWARD,
    ROLLOUT_ATTEMPT,
    ROLLOUT_CREATED,
    ROLLOUT_STATUS,
    RUN_SUBJECT,
    check_id,
    check_recurring_id,
    new_id,
)
from schemas.refs import CallRef, PackedTokens
from schemas.runs import RunSpec

SCHEMA_VERSION = 5
"""2: a `model_request` may carry `prompt_ref` (only the new ids and request parts) and `packed` arrays.
3: `model_request` gained `agent`, `endpoint`, `started_at` and the sampling parameters.
4: fields equal to their default are left out of the JSON (absent = default), except the envelope keys.
5: `run.started` carries its run's spec typed, as `spec` (older events carry a plain `config` mapping)."""

ENVELOPE_KEYS = ("type", "event_id", "schema_version", "run_id", "time")
"""The keys every encoded event carries, whatever their values (monitors in any language rely on them)."""

RolloutStatus = Literal["queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
Mode = Literal["train", "val"]
CallStatus = Literal["ok", "failed", "aborted"]
CallApi = Literal["chat", "responses", "messages"]
ReasoningParser = Literal["qwen3", "deepseek_r1"]
"""vLLM's reasoning parsers whose format continuous prompt mode reads: a leading `<think>…</think>` block."""
Phase = Literal["rollout", "update"]
EventSource = Literal["agent", "evaluator", "admin"]
FailureCause = Literal["timeout", "agent-error", "infrastructure"]
"""Why an attempt failed, as the controller knows it (not from any log text): `timeout` (the agent
ran past its time limit), `agent-error` (the agent exited non-zero on its own), `infrastructure`
(anything the policy did not cause: a launch, the evaluator, an OOM kill, a lost node, the gateway
or engine down, time held by the update gate)."""
"""Who wrote a reward or custom event: an attempt's agent token, its evaluator token, or the admin (a
service: the trainer, the controller, the gateway itself, a monitor, an operator)."""
RewardSource = EventSource

TRAIN_STEP_EVENT = "train_step"
"""The trainer's record of a step on each rollout it trains (what `rollwire replay --step` reads)."""
BUDGET_EXCEEDED_EVENT = "budget_exceeded"
"""The gateway's record that an attempt ran out of budget (the runaway monitor reports it)."""
LOG_EVENT = "log"
"""The controller's link to an execution's logs."""
FLAG_EVENT = "flag"
"""A monitor's flag on a rollout; the projector counts every name starting with `flag` as a flag."""
CALL_STARTED_EVENT = "call_started"
"""The proxy's in-flight marker of calls recorded before markers moved to a key-value bucket."""
RESERVED_EVENT_NAMES = frozenset({TRAIN_STEP_EVENT, BUDGET_EXCEEDED_EVENT, LOG_EVENT, FLAG_EVENT, CALL_STARTED_EVENT})
"""Custom event names other parts of Rollwire act on: an agent may not write them (nor any `flag...`)."""


def reserved_event_name(name: str) -> bool:
    """True for a custom event name other parts act on (`RESERVED_EVENT_NAMES`, or any name starting `flag`)."""
    return name in RESERVED_EVENT_NAMES or name.startswith(FLAG_EVENT)


def _schema_version() -> int:
    return SCHEMA_VERSION


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True, gc=False):
    """The envelope every event carries.

    `omit_defaults=True`: a field equal to its default is not encoded, and decoding a missing field
    gives the default back, so an event decodes to exactly what was encoded. `event_id`,
    `schema_version` and `time` are filled by the constructor (a default factory), which msgspec
    never omits: they, `type` and `run_id` are on every encoded event (`ENVELOPE_KEYS`). msgspec
    recognises a string or float default only when the value is the default object itself, so the
    constructor puts the default object in place of an equal value (a mode read from a URL, a
    status from a database row): equal events encode alike.

    `gc=False`: events hold only plain data and never form reference cycles, so the garbage
    collector need not track them (replaying millions of events is then markedly faster).
    """

    run_id: str
    rollout_id: str | None = None
    attempt_id: str | None = None
    event_id: str = msgspec.field(default_factory=new_id)
    schema_version: int = msgspec.field(default_factory=_schema_version)
    time: float = msgspec.field(default_factory=time.time)

    def __post_init__(self) -> None:
        check_recurring_id("run_id", self.run_id)
        if self.rollout_id is not None:
            check_recurring_id("rollout_id", self.rollout_id)
        if self.attempt_id is not None:
            check_recurring_id("attempt_id", self.attempt_id)
        check_id("event_id", self.event_id)
        for name, default in _BY_IDENTITY.get(type(self), ()):
            value = getattr(self, name)
            if value is not default and value == default and type(value) is type(default):
                msgspec.structs.force_setattr(self, name, default)

    @property
    def subject(self) -> str:
        """The NATS subject this event is published on."""
        raise NotImplementedError

    def _rollout(self) -> str:
        if self.rollout_id is None:
            raise msgspec.ValidationError(f"{type(self).__name__} needs a rollout_id")
        return self.rollout_id


class RunStarted(Event, frozen=True, kw_only=True, tag="run.started"):
    """A run was declared: how its rollouts execute and how they are trained (`schemas.runs.RunSpec`).

    `spec` is the run's spec, typed: an event whose spec is not a valid `RunSpec` does not decode.
    Events written before schema version 5 carry the spec as a plain `config` mapping instead
    (`spec` absent); `schemas.run.spec_of` reads either, and says why an old mapping is invalid.
    """

    name: str = ""
    spec: RunSpec | None = None
    config: dict[str, Any] = {}
    """The spec of an event written before schema version 5 (new events leave it empty)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.spec is not None and self.spec.run_id != self.run_id:
            raise msgspec.ValidationError(f"spec.run_id {self.spec.run_id} is not the event's run {self.run_id}")

    @property
    def subject(self) -> str:
        return RUN_SUBJECT.format(run=self.run_id)


class RolloutCreated(Event, frozen=True, kw_only=True, tag="rollout.created"):
    """A rollout was declared: one task input, in a group of rollouts of the same task."""

    input: Any = None
    group_id: str | None = None
    mode: Mode = "train"
    metadata: dict[str, Any] = {}
    max_attempts: Positive = 1
    config: dict[str, Any] = {}
    """Executor-facing settings of this rollout (Agent Lightning's `RolloutConfig`: timeout, local, k8s)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("max_attempts", self.max_attempts, 1, optional=False)

    @property
    def subject(self) -> str:
        return ROLLOUT_CREATED.format(run=self.run_id, rollout=self._rollout())


class RolloutStatusChanged(Event, frozen=True, kw_only=True, tag="rollout.status"):
    """A rollout moved to a new status; `attempt_id` names the attempt the change is about."""

    status: RolloutStatus
    previous: RolloutStatus | None = None
    reason: str | None = None
    cause: FailureCause | None = None
    """On `requeuing` and `failed`: the controller's classification of the failure (`reason` is for a
    person, and may quote the agent's log); None when not known (older events, other writers)."""

    @property
    def subject(self) -> str:
        return ROLLOUT_STATUS.format(run=self.run_id, rollout=self._rollout())


class AttemptStarted(Event, frozen=True, kw_only=True, tag="attempt.started"):
    """A new attempt of a rollout began (`attempt_id` in the envelope; `sequence` counts from 1)."""

    sequence: Positive
    executor: str | None = None
    expires_at: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sequence", self.sequence, 1, optional=False)

    @property
    def subject(self) -> str:
        return ROLLOUT_ATTEMPT.format(run=self.run_id, rollout=self._rollout())


class ModelRequestRecorded(Event, frozen=True, kw_only=True, tag="model_request"):
    """One model call (one choice of it) crossed the proxy: the exact tokens and logprobs.

    `prompt_ids` are the tokens the engine consumed, `response_ids` the tokens it sampled and
    `logprobs[i]` the behaviour log-probability of `response_ids[i]`. Only calls with
    `status == "ok"` are training data; failed and aborted calls are kept for inspection.
    `api` is the API the harness called (`chat`, `responses`, `messages`); `request` and
    `response` are always in chat-completions form (what the engine was asked and answered).

    Version 2: with `prompt_ref`, `prompt_ids` holds only the ids after the referenced call's
    first `prompt_ref.tokens` tokens and `request` only what is new (`schemas.refs.Resolver`
    puts them back); with `packed`, the id and logprob arrays are in it instead (decoding
    unpacks them, see `schemas.refs.upcast`). Version 4: a packed call's JSON has no
    `prompt_ids`, `response_ids` or `logprobs` keys at all (nor any other field at its default).
    """

    call_id: str
    mode: Mode = "train"
    status: CallStatus = "ok"
    choice_index: Count = 0
    model: str = ""
    weights_version: Int32 | None = None
    prompt_ids: list[Count] = []
    response_ids: list[Count] = []
    logprobs: list[float] = []
    finish_reason: str | None = None
    request: dict[str, Any] = {}
    response: dict[str, Any] = {}
    usage: dict[str, Count] = {}
    latency_s: float = 0.0
    error: str | None = None
    agent: str | None = None
    """The agent (role, sub-agent) that made the call: the proxy path's `agent/{name}` or `X-Rollwire-Agent`."""
    endpoint: str | None = None
    """The registered model name the proxy routed the call to (`model` is what the endpoint answered)."""
    started_at: float | None = None
    """Unix time the proxy received the call (before its budget and the phase gate, so a call held
    there still overlaps the calls that ran meanwhile); `time` is when it was recorded."""
    temperature: float | None = None
    """Sampling parameters the engine sampled with (None: the engine's default, 1.0 / 1.0 / off)."""
    top_p: float | None = None
    top_k: int | None = None
    api: CallApi = "chat"
    prompt_ref: CallRef | UnsetType | None = UNSET
    packed: PackedTokens | UnsetType | None = UNSET
    continuity: str | UnsetType | None = UNSET
    """Continuous prompt mode only: `extended` (the prompt starts with an earlier call's prompt +
    sampled ids, verbatim) or `fresh: <why>` (rendered from the messages: a new chain starts)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("choice_index", self.choice_index, 0, optional=False)
        check_int("weights_version", self.weights_version)

    @property
    def subject(self) -> str:
        return MODEL_REQUEST.format(run=self.run_id, rollout=self._rollout())


class RewardReported(Event, frozen=True, kw_only=True, tag="reward"):
    """A scalar reward for a rollout attempt (the last one of the succeeded attempt counts)."""

    value: float
    name: str | None = None
    step: Int32 | None = None
    source: EventSource = "agent"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("step", self.step)

    @property
    def subject(self) -> str:
        return REWARD.format(run=self.run_id, rollout=self._rollout())


class CustomEvent(Event, frozen=True, kw_only=True, tag="custom"):
    """A user-defined event (logs, monitor flags, spans): free-form JSON payload.

    `source` is who wrote it (the gateway sets it from the token that posted it). Absent means
    `admin`: the services that write events straight to the stream, and every event written before
    the field existed. Whoever acts on an event's name checks `trusted` first: an agent may write
    any name but the reserved ones (`reserved_event_name`), and its events are never taken for
    the system's.
    """

    name: str
    payload: dict[str, Any] = {}
    source: EventSource = "admin"

    @property
    def trusted(self) -> bool:
        """True unless the agent under training wrote it (an evaluator's or a service's event)."""
        return self.source != "agent"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id("name", self.name)

    @property
    def subject(self) -> str:
        return CUSTOM_EVENT.format(run=self.run_id, rollout=self._rollout(), name=self.name)


class ModelRegistered(Event, frozen=True, kw_only=True, tag="model.registered"):
    """An inference endpoint was registered under `name` for the run."""

    name: str
    base_url: str
    served_model: str | None = None
    weights_version: Int32 | None = None
    api_key: str | None = None
    tokenizer: str | UnsetType | None = UNSET
    """Continuous prompt mode: the model directory (tokenizer.json, chat template) the proxy renders
    prompts with; unset, the proxy fetches them once from the engine's `GET /v1/tokenizer`."""
    reasoning_parser: ReasoningParser | UnsetType | None = UNSET
    """Continuous prompt mode: how sampled text holds reasoning (vLLM's `--reasoning-parser` names)."""
    adapters: dict[str, str] = {}
    """Agent name -> the model name sent upstream for that agent's calls (a LoRA adapter vLLM serves
    for the agent's role); other agents' calls go to `served_model`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id("name", self.name)
        check_int("weights_version", self.weights_version)
        if len(self.adapters) > 256:
            raise ValueError("adapters: at most 256 agents")
        for agent, adapter in self.adapters.items():
            check_id("adapters agent", agent)
            check_id("adapters model", adapter)

    @property
    def subject(self) -> str:
        return MODEL.format(run=self.run_id, name=self.name)


class ModelRemoved(Event, frozen=True, kw_only=True, tag="model.removed"):
    """The endpoint registered under `name` was removed."""

    name: str

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id("name", self.name)

    @property
    def subject(self) -> str:
        return MODEL.format(run=self.run_id, name=self.name)


class PhaseChanged(Event, frozen=True, kw_only=True, tag="phase"):
    """Collocated-async phase switch: `update` holds new calls, `rollout` serves `weights_version`."""

    phase: Phase
    weights_version: Int32 | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("weights_version", self.weights_version)

    @property
    def subject(self) -> str:
        return PHASE.format(run=self.run_id)


AnyEvent = Union[  # noqa: UP007 - a runtime union object msgspec decodes into
    RunStarted,
    RolloutCreated,
    RolloutStatusChanged,
    AttemptStarted,
    ModelRequestRecorded,
    RewardReported,
    CustomEvent,
    ModelRegistered,
    ModelRemoved,
    PhaseChanged,
]

EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__  # type: ignore[attr-defined]

_BY_IDENTITY: dict[type[Event], tuple[tuple[str, Any], ...]] = {
    event_type: tuple(
        (f.name, f.default)
        for f in msgspec.structs.fields(event_type)
        if type(f.default) in (str, float) and f.default != ""
    )
    for event_type in EVENT_TYPES
}
"""Per event type, the defaults `omit_defaults` recognises only by identity: non-empty strings, floats."""
