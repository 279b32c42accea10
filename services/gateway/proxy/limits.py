"""Per-call limits of the proxy: what one model call may ask for, from the run's spec.

Each choice of a call is recorded with the call's whole request, so `n` multiplies what a call
writes to the stream (`n=1000` with a 10k-character prompt once wrote 51 MB); `max_tokens`, the
number of tools and the number of messages bound the rest. The limits are the run spec's
`limits` (`schemas.runs.CallLimits`, with defaults for a run that sets none). A call over a limit
is refused before anything is forwarded or recorded, with a 400 in OpenAI's error shape naming
the parameter, so the harness's client raises its ordinary `BadRequestError`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.bounds import INT32_MAX
from schemas.runs import CallLimits
from services.gateway.errors import ApiError
from services.gateway.http import finite_number


class ProxyRefusal(ApiError):
    """A refusal of a proxied call: the proxy answers it in the caller's API's error shape, with
    `type` = `kind` and the offending `param` (and a `code`, when given) inside the error object."""

    def __init__(self, status: int, message: str, *, kind: str, param: str | None = None, code: str | None = None):
        extra: dict[str, Any] = {"kind": kind, "param": param}
        if code is not None:
            extra["code"] = code
        super().__init__(status, message, **extra)


SAMPLING_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
SAMPLING_INTEGERS = {"top_k": (-1, INT32_MAX), "seed": (-(2**63), 2**63 - 1), "top_logprobs": (0, INT32_MAX)}
"""Sampling parameters checked before a call is forwarded: each must be a finite number (an integer in
range), so nothing the engine generates is lost to a value the call's record cannot hold."""


def check_sampling(request: dict[str, Any]) -> None:
    """Refuse (ProxyRefusal, 400) a sampling parameter that is not a finite number, or not an integer in range.

    Only the type and the range a record holds are checked; what the values mean (a top_p above 1)
    is the engine's to refuse, so nothing an engine accepts is refused here."""
    for name in SAMPLING_NUMBERS:
        value = request.get(name)
        if value is not None and not finite_number(value):
            raise ProxyRefusal(400, f"{name} must be a finite number", kind="invalid_request_error", param=name)
    for name, (low, high) in SAMPLING_INTEGERS.items():
        value = request.get(name)
        if value is None:
            continue
        whole = finite_number(value) and float(value).is_integer()
        if not whole or not low <= value <= high:
            raise ProxyRefusal(
                400, f"{name} must be an integer from {low} to {high}", kind="invalid_request_error", param=name
            )


def _count(request: dict[str, Any], name: str, default: int = 1) -> int:
    value = request.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProxyRefusal(400, f"{name} must be an integer", kind="invalid_request_error", param=name)
    return value


def check_call(request: dict[str, Any], limits: CallLimits) -> None:
    """Refuse (ProxyRefusal, 400) a chat-completions request over the run's per-call limits.

    `max_tokens` over the limit is not refused but lowered (`clamp_max_tokens`): harnesses send a
    fixed ceiling of their own (Claude Code asks for 64,000 on every call) that the engine caps anyway."""
    check_sampling(request)
    n = _count(request, "n")
    if not 1 <= n <= limits.max_n:
        raise ProxyRefusal(
            400, f"n={n} is outside 1..{limits.max_n}, this run's limit", kind="invalid_request_error", param="n"
        )
    for name in ("max_tokens", "max_completion_tokens"):
        if _count(request, name, 1) < 1:
            raise ProxyRefusal(400, f"{name} must be at least 1", kind="invalid_request_error", param=name)
    for name, limit in (("messages", limits.max_messages), ("tools", limits.max_tools)):
        items = request.get(name)
        if items is not None and not isinstance(items, list):
            raise ProxyRefusal(400, f"{name} must be a list", kind="invalid_request_error", param=name)
        if items is not None and len(items) > limit:
            raise ProxyRefusal(
                400,
                f"{len(items)} {name} exceed this run's limit of {limit}",
                kind="invalid_request_error",
                param=name,
            )


def clamp_max_tokens(payload: bytes, request: dict[str, Any], limits: CallLimits) -> tuple[bytes, dict[str, Any]]:
    """(payload, request) with `max_tokens` / `max_completion_tokens` lowered to the run's limit;
    the same objects when nothing is over it (the common case costs no re-encoding)."""
    over = [name for name in ("max_tokens", "max_completion_tokens") if _count(request, name, 1) > limits.max_tokens]
    if not over:
        return payload, request
    body = msgspec.json.decode(payload)
    lowered = {name: limits.max_tokens for name in over}
    return msgspec.json.encode({**body, **lowered}), {**request, **lowered}


RECORD_OVERHEAD = 4096
"""Bytes a call's record may take beyond its request copy (the error text, ids, envelope): what a call
reserves of its attempt's byte budget is its payload plus this."""


def asked(
    payload: bytes, request: dict[str, Any], limits: CallLimits, prompt_size: int | None = None
) -> tuple[int, int, int]:
    """(prompt tokens at most, n, max_tokens) a call may spend, for its reservation against the budget.

    A token-in prompt's size is known (`prompt_size`, its ids); otherwise the payload's size in
    bytes bounds it (no token is shorter than a byte of the request that renders it). A call that
    names no `max_tokens` may run to the run's per-call limit."""
    prompt = len(payload) if prompt_size is None else prompt_size
    names = [name for name in ("max_tokens", "max_completion_tokens") if request.get(name) is not None]
    wanted = min((_count(request, name, 1) for name in names), default=limits.max_tokens)
    return prompt, _count(request, "n"), min(wanted, limits.max_tokens)


def lower_max_tokens(payload: bytes, request: dict[str, Any], value: int) -> tuple[bytes, dict[str, Any]]:
    """(payload, request) with the call's `max_tokens` (and `max_completion_tokens`, if sent) set to `value`:
    what is left of the attempt's token budget."""
    body = msgspec.json.decode(payload)
    lowered = {"max_tokens": value} | ({"max_completion_tokens": value} if "max_completion_tokens" in body else {})
    recorded = {"max_tokens": value} | ({"max_completion_tokens": value} if "max_completion_tokens" in request else {})
    return msgspec.json.encode({**body, **lowered}), {**request, **recorded}
