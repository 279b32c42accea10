"""Idempotency keys: a repeated command returns the first result and appends nothing.

Two layers. Event ids (and the ids of rollouts and attempts a command creates) are derived from
the `Idempotency-Key`, so a retry that reaches JetStream is acknowledged as a duplicate of the
first append (`Nats-Msg-Id`), even from another gateway process. And inside one process,
concurrent or repeated requests with the same key wait for the first one and get its response,
so five identical commands in flight produce one event and five identical answers.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable

from services.common.bytecache import ByteLRU
from services.gateway.errors import ApiError

Result = tuple[int, bytes]


def derive_id(key: str, *parts: str, length: int = 32) -> str:
    """A stable id (hex) for what a command with this key creates; `parts` name which thing."""
    digest = hashlib.sha256("\x1f".join((key, *parts)).encode()).hexdigest()
    return digest[:length]


class IdempotencyCache:
    """Responses of keyed commands, by (scope, method, path, key), bounded by bytes.

    Each entry is charged its key, its request fingerprint and, once answered, its response body,
    so a client sending large bodies under fresh keys evicts old entries instead of growing the
    gateway. An evicted key is still safe to retry: the ids a command derives from its key make
    the repeated append a duplicate, and creation answers the stored rollout (see `api.py`).
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._entries: ByteLRU[tuple[str, ...], tuple[str, asyncio.Future[Result]]] = ByteLRU(max_bytes, _entry_size)

    @property
    def bytes(self) -> int:
        """Bytes held now (what the bound applies to)."""
        return self._entries.bytes

    def __len__(self) -> int:
        return len(self._entries)

    async def run(self, scope: tuple[str, ...], fingerprint: str, command: Callable[[], Awaitable[Result]]) -> Result:
        """Run `command` once per key; repeats (same body) get the first successful result."""
        entry = self._entries.get(scope)
        if entry is not None:
            if entry[0] != fingerprint:
                raise ApiError(409, "this Idempotency-Key was already used with a different request; use a fresh key")
            return await asyncio.shield(entry[1])
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._entries.put(scope, (fingerprint, future))
        try:
            result = await command()
        except BaseException as exc:
            # A failed command is not remembered: the retry runs again (and the derived event
            # ids still make any append that did land a duplicate).
            self._entries.pop(scope)
            future.set_exception(exc)
            future.exception()
            raise
        future.set_result(result)
        if result[0] >= 300:
            self._entries.pop(scope)
        else:
            self._entries.resize(scope)  # now charged its response too
        return result


def _entry_size(entry: tuple[str, asyncio.Future[Result]]) -> int:
    fingerprint, future = entry
    body = len(future.result()[1]) if future.done() and not future.exception() else 0
    return len(fingerprint) + body
