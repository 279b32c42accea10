"""Request bodies of the rollout API, as msgspec Structs (so a wrong type is a 422 naming the field).

Where Agent Lightning 1.0 and Rollwire's contract shape a body differently, both are accepted:
a bare list or `{"rollouts": [...]}` for a batch, `{"status": "running"}` or
`{"status": {"state": "running", ...}}` for a patch, `{"type": "reward", ...}` or
`{"event_type": ..., "data": ...}` for an event, `[{model, endpoint, version}]` or
`{name, base_url, ...}` for a model.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from schemas import FailureCause, RolloutStatus
from schemas.bounds import Int32, Positive
from schemas.events import ReasoningParser
from schemas.ids import Id

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class NewRollout(msgspec.Struct, kw_only=True):
    """One rollout to create (Agent Lightning's `RolloutCreate` plus Rollwire's fields)."""

    input: Any
    rollout_id: Id | None = None
    run_id: Id | None = None
    group_id: str | None = None
    mode: Literal["train", "val"] | None = None
    is_train: bool | None = None
    metadata: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    max_attempts: Positive | None = None


class RolloutBatch(msgspec.Struct, kw_only=True):
    """Rollwire's batch shape: `{"rollouts": [...]}`."""

    rollouts: list[NewRollout]


class AglStatusPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Agent Lightning's nested status patch."""

    state: RolloutStatus | None = None
    k8s_job_name: str | None = None
    last_attempt_id: Id | None = None
    error_message: str | None = None


class RolloutPatch(msgspec.Struct, kw_only=True):
    """`PATCH /api/rollouts/{id}`: a status string (Rollwire) or a status object (Agent Lightning)."""

    status: RolloutStatus | AglStatusPatch | None = None
    attempt_id: Id | None = None
    reason: str | None = None
    cause: FailureCause | None = None


class NewAttempt(msgspec.Struct, kw_only=True):
    """`POST /api/rollouts/{id}/attempts`."""

    executor: str | None = None


class EventBody(msgspec.Struct, kw_only=True):
    """An event posted for an attempt: a reward, a custom event, or Agent Lightning's `EventCreate`."""

    type: Literal["reward", "custom"] | None = None
    value: float | None = None
    name: str | None = None
    step: Int32 | None = None
    payload: dict[str, Any] | None = None
    event_type: str | None = None
    data: dict[str, Any] | None = None


class AglModel(msgspec.Struct, kw_only=True):
    """Agent Lightning's `Model`: one endpoint of a served model."""

    model: str
    endpoint: str
    version: Int32 = 0


class ModelBody(msgspec.Struct, kw_only=True):
    """Rollwire's model registration."""

    name: Id
    base_url: str
    run_id: Id | None = None
    served_model: str | None = None
    weights_version: Int32 | None = None
    api_key: str | None = None
    tokenizer: str | None = None
    reasoning_parser: ReasoningParser | None = None
    adapters: dict[NonEmpty, NonEmpty] = {}


class PhaseBody(msgspec.Struct, kw_only=True):
    """`POST /api/phase`."""

    phase: Literal["rollout", "update"]
    run_id: Id | None = None
    weights_version: Int32 | None = None
