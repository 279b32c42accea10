"""Id rules and subject templates: the one place that says how ids become NATS subjects.

Every id that appears in a subject (run, rollout, attempt, model name, custom-event name) must be
subject-safe, so that `rl.<run>.rollout.<rollout>.reward` always has exactly the tokens a
monitor's wildcard expects. Ids are also used in URLs, so the rule is strict: 1-128 characters,
no `.`, `*`, `>`, no whitespace or control characters, no `/`.
"""

from __future__ import annotations

import os
import re
from typing import Annotated

import msgspec

MAX_ID_LENGTH = 128
_BANNED = r".*>/\x00-\x20\x7f-\xa0\u1680\u2000-\u200b\u2028\u2029\u202f\u205f\u3000\ufeff"
r"""`.`, `*`, `>`, `/`, control characters and every Unicode space (a superset of Python's `\s`,
spelled out so that the JSON Schema `pattern` below means the same in every regex dialect)."""
_FORBIDDEN = re.compile(rf"[{_BANNED}]")
_VALID = re.compile(rf"[^{_BANNED}]{{1,{MAX_ID_LENGTH}}}")
ID_PATTERN = rf"^[^{_BANNED}]{{1,{MAX_ID_LENGTH}}}$"
"""The id rule as a regular expression (for JSON Schema and OpenAPI)."""

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)]
"""A subject-safe id as a field type: decoding checks it, and JSON Schemas state the rule."""

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
            f"{kind} {value!r} contains {bad.group()!r}; ids may not contain '.', '*', '>', '/', "
            "whitespace or control characters"
        )
    return value


_RECURRING: dict[str, None] = {}
_RECURRING_MAX = 4096


def check_recurring_id(kind: str, value: object) -> str:
    """`check_id` for ids that recur across events (run, rollout, attempt): the last few thousand
    valid ones are remembered, so a read of a run checks each of them about once.

    A dictionary lookup costs a quarter of the pattern match; the three ids every event carries
    were a tenth of decoding it. Forgotten all at once when full (a bound on what an untrusted
    stream can make this process keep).
    """
    if type(value) is str and value in _RECURRING:
        return value
    valid = check_id(kind, value)
    if len(_RECURRING) >= _RECURRING_MAX:
        _RECURRING.clear()
    _RECURRING[valid] = None
    return valid


def new_id(prefix: str = "") -> str:
    """A fresh random id (32 hex characters, 128 random bits), optionally prefixed (`ro-...`).

    The bits straight from `os.urandom`: `uuid.uuid4().hex` takes five times as long (3.3 against
    0.6 us here), and the proxy makes one for every model call."""
    return f"{prefix}{os.urandom(16).hex()}"
