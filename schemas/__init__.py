"""Rollwire's event contract: event Structs, their JSON codec, subject templates and id rules."""

from schemas.codec import MalformedEvent, decode, encode, from_dict, to_dict
from schemas.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    TERMINAL_STATUSES,
    AnyEvent,
    AttemptStarted,
    CustomEvent,
    Event,
    ModelRegistered,
    ModelRemoved,
    ModelRequestRecorded,
    PhaseChanged,
    RewardReported,
    RolloutCreated,
    RolloutStatus,
    RolloutStatusChanged,
    RunStarted,
)
from schemas.ids import InvalidId, check_id, new_id
from schemas.refs import CallRef, PackedTokens, Resolver, UnresolvedReference, upcast
from schemas.transitions import IllegalTransition, check_transition, is_terminal

__all__ = [
    "EVENT_TYPES",
    "SCHEMA_VERSION",
    "TERMINAL_STATUSES",
    "AnyEvent",
    "AttemptStarted",
    "CallRef",
    "CustomEvent",
    "Event",
    "IllegalTransition",
    "InvalidId",
    "MalformedEvent",
    "ModelRegistered",
    "ModelRemoved",
    "ModelRequestRecorded",
    "PackedTokens",
    "PhaseChanged",
    "Resolver",
    "RewardReported",
    "RolloutCreated",
    "RolloutStatus",
    "RolloutStatusChanged",
    "RunStarted",
    "UnresolvedReference",
    "check_id",
    "check_transition",
    "decode",
    "encode",
    "from_dict",
    "is_terminal",
    "new_id",
    "to_dict",
    "upcast",
]
