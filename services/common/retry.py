"""Retries with capped exponential backoff: the one way Rollwire waits and tries again.

    result = await retry_async(call, backoff=Backoff(0.25, 4.0), transient=(httpx.TransportError, RetryableStatus),
                               retries=6)

A failure is retried when it is one of `transient` and not one of `permanent`; the delay before
retry n (from 0) is `backoff.delay(n)`, unless the exception carries its own `retry_after` (a
server's `Retry-After`, a backend's hint), which wins. After `retries` retries (None: no limit)
the last failure is raised as it is, so callers keep their own error types. Every caller makes
its retried call safe to repeat (idempotency keys, expected sequences).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

RETRY_STATUSES = frozenset({502, 503, 504})
"""HTTP statuses that mean "not now" (a proxy or a server that is starting or overloaded)."""


class Backoff(msgspec.Struct, frozen=True):
    """Delays `initial`, 2x, 4x, ... capped at `maximum`, each scaled by a random factor in [1 - jitter, 1 + jitter]."""

    initial: float = 0.25
    maximum: float = 5.0
    jitter: float = 0.0

    def delay(self, attempt: int) -> float:
        """The delay before retry `attempt` (0 for the first retry)."""
        base = min(self.maximum, self.initial * 2.0 ** min(attempt, 62))
        return base * (1.0 + self.jitter * (2.0 * random.random() - 1.0)) if self.jitter else base


class RetryableStatus(Exception):
    """An HTTP answer with a status in `RETRY_STATUSES`, raised so that the request is retried."""

    def __init__(self, response: Any) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


def check_status(response: T) -> T:
    """`response` unless its status asks to retry later (then `RetryableStatus`)."""
    if getattr(response, "status_code", 200) in RETRY_STATUSES:
        raise RetryableStatus(response)
    return response


def _delay(exc: BaseException, backoff: Backoff, attempt: int) -> float:
    hint = getattr(exc, "retry_after", None)
    return float(hint) if isinstance(hint, int | float) and hint >= 0 else backoff.delay(attempt)


async def retry_async(
    call: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    transient: tuple[type[BaseException], ...],
    permanent: tuple[type[BaseException], ...] = (),
    retries: int | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> T:
    """Await `call()` until it succeeds, retrying `transient` failures (see the module docstring).

    `on_retry(exc, delay)` is told of each retry (to log it, to record it); `sleep` waits (a
    service passes one that ends early when it is asked to stop).
    """
    attempt = 0
    while True:
        try:
            return await call()
        except permanent:
            raise
        except transient as exc:
            if retries is not None and attempt >= retries:
                raise
            delay = _delay(exc, backoff, attempt)
            if on_retry is not None:
                on_retry(exc, delay)
        attempt += 1
        await sleep(delay)


def retry_sync(
    call: Callable[[], T],
    *,
    backoff: Backoff,
    transient: tuple[type[BaseException], ...],
    retries: int | None = None,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """`retry_async` for blocking code (the agent-side helper runs in plain scripts)."""
    attempt = 0
    while True:
        try:
            return call()
        except transient as exc:
            if retries is not None and attempt >= retries:
                raise
            delay = _delay(exc, backoff, attempt)
        attempt += 1
        sleep(delay)
