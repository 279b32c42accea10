"""A token bucket that books slots ahead, so concurrent callers are spaced out, not raced.

`reserve()` takes a token now if one is saved up; otherwise it books the next free slot and
returns how long the caller must wait for it. The bucket may go into debt by the number of
waiting callers, which is what spaces them exactly `1/rate` apart. The clock and the sleep are
injectable, so a test can check the schedule without waiting for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class TokenBucket:
    """`rate` operations per second on average, with up to `burst` at once after a quiet spell."""

    def __init__(
        self,
        rate: float,
        burst: int = 1,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}; to disable the limit, use no bucket")
        if burst < 1:
            raise ValueError(f"burst must be at least 1, got {burst}")
        self.rate = float(rate)
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._last = clock()

    def reserve(self) -> float:
        """Take one token; return the seconds to wait before using it (0.0 if it is available now)."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def acquire(self) -> None:
        """Wait for a token. A caller cancelled while waiting gives its slot back."""
        delay = self.reserve()
        if delay <= 0:
            return
        try:
            await self._sleep(delay)
        except asyncio.CancelledError:
            self._tokens = min(float(self.burst), self._tokens + 1.0)
            raise
