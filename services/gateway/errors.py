"""HTTP errors as JSON: every refusal names the problem, and nothing a client sends becomes a 500."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from schemas import IllegalTransition, InvalidId, MalformedEvent
from schemas.rollout import AttemptView, RolloutView
from services.common.eventstore import ConcurrencyConflict, EventStoreUnavailable, StoreFull
from services.common.readside import ReadSideError

RETRY_AFTER_S = 2
PERMANENT = frozenset({400, 401, 403, 404, 405, 409, 413, 422})
"""Refusals that a retry of the same request cannot change: answered with `x-should-retry: false`,
the header the OpenAI and Anthropic SDKs (and Claude Code) obey instead of retrying on their own."""
log = logging.getLogger("rollwire.gateway")
_encoder = msgspec.json.Encoder()
_FIELD = re.compile(r"at `\$\.?([^`]*)`")


class ApiError(Exception):
    """A refusal with an HTTP status; the body is `{"error": message, **extra}`."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = retry_headers(status) | (headers or {})
        self.extra = extra

    def body(self) -> bytes:
        """The JSON body of the error response."""
        return _encoder.encode({"error": self.message, **self.extra})


def retry_headers(status: int) -> dict[str, str]:
    """`x-should-retry: false` for a permanent refusal (`PERMANENT`); nothing otherwise."""
    return {"x-should-retry": "false"} if status in PERMANENT else {}


def unauthorized(message: str = "missing or invalid token: send `Authorization: Bearer <token>`") -> ApiError:
    """401: no token, or one we did not issue."""
    return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> ApiError:
    """403: a valid token whose scope does not cover this request."""
    return ApiError(403, message)


def not_found(message: str) -> ApiError:
    """404: no such rollout, attempt, run or model."""
    return ApiError(404, message)


def unavailable(message: str) -> ApiError:
    """503 with Retry-After: the event store cannot take the command right now."""
    return ApiError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def invalid(message: str, field: str | None = None) -> ApiError:
    """422 naming the offending field."""
    if field is None:
        return ApiError(422, message)
    return ApiError(422, message, field=field)


def too_deep() -> ApiError:
    """422 for JSON nested deeper than the decoder follows (about a thousand levels)."""
    return invalid("the JSON body is nested too deeply to decode; no API here needs more than a few levels", "body")


def too_large(limit: int) -> ApiError:
    """413 naming the limit."""
    return ApiError(413, f"request body is larger than the limit of {limit} bytes (ROLLWIRE_MAX_BODY_BYTES)")


def from_validation(exc: Exception, prefix: str = "") -> ApiError:
    """A 422 from a msgspec or id validation error, with the field path it names."""
    text = str(exc)
    match = _FIELD.search(text)
    field = match.group(1) if match else None
    if isinstance(exc, InvalidId):
        field = text.split(" ", 1)[0]
    if prefix and field:
        field = f"{prefix}.{field}"
    return invalid(text, field)


CLIENT_ERRORS: tuple[type[Exception], ...] = (
    ApiError,
    EventStoreUnavailable,
    nats.errors.Error,
    ConcurrencyConflict,
    IllegalTransition,
    msgspec.ValidationError,
    InvalidId,
    MalformedEvent,
    ReadSideError,
)
"""Exceptions `translate` answers (4xx/503): handled as answers, never logged as tracebacks."""


def internal(exc: BaseException) -> ApiError:
    """A 500 that reveals nothing internal: the body carries a reference, the log the traceback."""
    ref = uuid.uuid4().hex[:12]
    log.error("internal error (ref %s)", ref, exc_info=exc)
    return ApiError(500, f"internal error (ref {ref}); the gateway's log has the details", ref=ref)


def translate(exc: Exception) -> ApiError | None:
    """The HTTP error for a known domain exception (None for anything else)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StoreFull):
        return unavailable(f"{exc}; nothing was changed")
    if isinstance(exc, EventStoreUnavailable) or (
        isinstance(exc, nats.errors.Error) and not isinstance(exc, nats.js.errors.APIError)
    ):
        return unavailable("the event store (NATS) is unavailable; nothing was changed, retry later")
    if isinstance(exc, ConcurrencyConflict):
        return ApiError(409, f"another writer changed this rollout first: {exc}")
    if isinstance(exc, IllegalTransition):
        return ApiError(409, str(exc), current={"status": exc.current})
    if isinstance(exc, (msgspec.ValidationError, InvalidId, MalformedEvent)):
        return from_validation(exc)
    if isinstance(exc, ReadSideError):  # the projector's answer, passed on as it gave it
        extra = {k: v for k, v in exc.body.items() if k != "error"}
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return ApiError(exc.status, str(exc), headers=headers, **extra)
    return None


def current_state(view: RolloutView | None, status: str | None = None) -> dict[str, Any]:
    """The `current` field of a 409: where the rollout stands."""
    if view is None:
        return {"status": status}
    return {"status": status or view.status, "attempt_id": view.attempt_id, "reason": view.reason}


def ended_attempt(view: RolloutView, attempt: AttemptView, refusal: str) -> ApiError:
    """The 409 for a token of an ended attempt: how that attempt ended (not the state of the attempt that
    replaced it) in words and in `attempt`, with the rollout as it stands now in `current`."""
    replaced = view.attempt_id if view.attempt_id != attempt.attempt_id else None
    ended_as = attempt.ended_as or ("superseded" if replaced else view.status)
    how = ended_as + (f": {attempt.reason}" if attempt.reason else "")
    if replaced:
        how += f"; attempt {replaced} replaced it and is {view.status}"
    return ApiError(
        409,
        f"attempt {attempt.attempt_id} of rollout {view.rollout_id} has ended ({how}); {refusal}",
        attempt={
            "attempt_id": attempt.attempt_id,
            "status": ended_as,
            "reason": attempt.reason,
            "replaced_by": replaced,
        },
        current=current_state(view),
    )
