"""No payload wall: a call that cannot be recorded is refused before the engine generates.

A call's `model_request` event must fit in one NATS message (the server's `max_payload`: 1 MB by
default, 8 MB under `rollwire up` and `docker compose up`). Before a call is forwarded, its event
is bounded from what is known: the request's new part (what the attempt's remembered calls do not
already hold, see `recording.py`), at most one prompt token per byte of it (a byte-level
tokenizer's worst case: 4 bytes each, packed), and `max_tokens` sampled tokens (id, logprob and
text). A call whose bound exceeds the limit gets a 413 in its API's shape (non-retryable: a retry
would be refused the same way) and is recorded as a failed call, with its request copy cut to its
size. A call that passed the bound but whose event still does not fit (an engine that ignored
`max_tokens`) is recorded as failed the same way, and the client gets the same error instead of the
answer (a stream ends with an error event), never a 503 that invites a retry.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

ENVELOPE_BYTES = 4096
"""The envelope, usage, response message framing and prompt reference of one event, generously."""
BYTES_PER_PROMPT_BYTE = 5
"""The request byte itself, plus at most one packed prompt id (4 base64 characters) per byte."""
BYTES_PER_SAMPLED_TOKEN = 32
"""A sampled token's packed id (4), float64 logprob (11) and its text in the response (up to 16)."""
DEFAULT_MAX_TOKENS = 4096
"""Assumed when a request sets no `max_tokens`."""

_encode = msgspec.json.Encoder().encode


def max_tokens(request: dict[str, Any]) -> int:
    """The request's bound on sampled tokens (all choices together)."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            break
    else:
        value = DEFAULT_MAX_TOKENS
    n = request.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    return int(value) * choices


def event_bound(new_request_bytes: int, request: dict[str, Any]) -> int:
    """An upper bound of the bytes a call's recorded event(s) can take, before it is generated."""
    return ENVELOPE_BYTES + BYTES_PER_PROMPT_BYTE * new_request_bytes + BYTES_PER_SAMPLED_TOKEN * max_tokens(request)


def refusal(limit: int, new_request_bytes: int, request: dict[str, Any]) -> str | None:
    """Why a call cannot be recorded under `limit` bytes, or None when it can."""
    bound = event_bound(new_request_bytes, request)
    if bound <= limit:
        return None
    return (
        f"this call cannot be recorded: its new prompt ({new_request_bytes} bytes) and max_tokens "
        f"({max_tokens(request)}) could make an event of {bound} bytes, over the event store's limit of "
        f"{limit} bytes (NATS max_payload); send a shorter prompt or a smaller max_tokens, or raise the "
        "server's max_payload (up to 64 MB)"
    )


def cut_request(request: dict[str, Any], reason: str) -> dict[str, Any]:
    """What a failed call records in place of a request copy too large to store."""
    return {"omitted": {"bytes": len(_encode(request)), "reason": reason}}


def announce(limit: int) -> None:
    """Say at start what the server's max_payload means for the calls this gateway can record."""
    prompt = (limit - ENVELOPE_BYTES - BYTES_PER_SAMPLED_TOKEN * DEFAULT_MAX_TOKENS) // BYTES_PER_PROMPT_BYTE
    note = " (NATS's default: run nats-server with max_payload 8MB, as rollwire up does)" if limit <= 1 << 20 else ""
    print(
        f"rollwire gateway: the event store accepts events of up to {limit} bytes{note}; calls whose new "
        f"prompt text exceeds about {max(prompt, 0) // 1024} KiB (with max_tokens {DEFAULT_MAX_TOKENS}) are "
        "refused before generation with a 413",
        file=sys.stderr,
        flush=True,
    )
