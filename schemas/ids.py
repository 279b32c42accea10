"""Id rules and subject templates: the one place that says how ids become NATS subjects.

Every id that appears in a subject (run, rollout, attempt, model name, custom-event name) must be
subject-safe, so that `rl.<run>.rollout.<rollout>.reward` always has exactly the tokens a
monitor's wildcard expects. Ids are also used in URLs, so the rule is strict: 1-128 characters,
no `.`, `*`, `>`, no whitespace, no `/`.
"""

from __future__ import annotations

import re
import uuid

MAX_ID_LENGTH = 128
_FORBIDDEN = re.compile(r"[.*>/\s]")
_VALID = re.compile(rf"[^.*>/\s]{{1,{MAX_ID_LENGTH}}}")

STREAM_NAME = "ROLLWIRE"
STREAM_SUBJECTS = "rl.>"

# Subject templates (the public contract for monitors; see schemas/README.md).
RUN_SUBJECT = "rl.{run}.run"
ROLLOUT_CREATED = "rl.{run}.rollout.{rollout}.created"
ROLLOUT_STATUS = "rl.{run}.rollout.{rollout}.status"
ROLLOUT_ATTEMPT = "rl.{run}.rollout.{rollout}.attempt"
MODEL_REQUEST = "rl.{run}.rollout.{rollout}.model_request"
REWARD = "rl.{run}.rollout.{rollout}.reward"
CUSTOM_EVENT = "rl.{run}.rollout.{rollout}.event.{name}"
MODEL = "rl.{run}.model.{name}"
PHASE = "rl.{run}.phase"
ROLLOUT_ALL = "rl.{run}.rollout.{rollout}.>"
RUN_ALL = "rl.{run}.>"


class InvalidId(ValueError):
    """An id that cannot be used in a subject or URL; the message says which id and why."""


def check_id(kind: str, value: object) -> str:
    """Return `value` if it is a subject-safe id, else raise `InvalidId` naming `kind` and the rule."""
    if type(value) is str and _VALID.fullmatch(value):  # the fast path: every event checks its ids
        return value
    if not isinstance(value, str):
        raise InvalidId(f"{kind} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidId(f"{kind} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidId(f"{kind} is {len(value)} characters long; the limit is {MAX_ID_LENGTH}")
    bad = _FORBIDDEN.search(value)
    if bad:
        raise InvalidId(
            f"{kind} {value!r} contains {bad.group()!r}; ids may not contain '.', '*', '>', '/' or whitespace"
        )
    return value


def new_id(prefix: str = "") -> str:
    """A fresh random id (32 hex characters), optionally prefixed (`ro-...`)."""
    return f"{prefix}{uuid.uuid4().hex}"
