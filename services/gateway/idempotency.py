"""Idempotency keys: a repeated command returns the first result and appends nothing.

Two layers. Event ids (and the ids of rollouts and attempts a command creates) are derived from
the `Idempotency-Key`, so a retry that reaches JetStream is acknowledged as a duplicate of the
first append (`Nats-Msg-Id`), even from another gateway process. And inside one process,
concurrent or repeated requests with the same key wait for the first one and get its response,
so five identical commands in flight produce one event and five identical answers. Across
processes, each key's request fingerprint is also created in the JetStream key-value bucket
`rollwire_idempotency` (an atomic create), so the same key with another body through another
gateway process is a 409 instead of being taken for a repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from services.common.bytecache import ByteLRU
from services.gateway.errors import ApiError

Result = tuple[int, bytes]
Recall = Callable[[], Awaitable[Result | None]]
"""What a keyed command wrote before, as its answer (None when it wrote nothing)."""
BUCKET = "rollwire_idempotency"
SHARED_TTL_S = 24 * 3600.0
"""How long a key's fingerprint is shared across gateway processes."""


def derive_id(key: str, *parts: str, length: int = 32) -> str:
    """A stable id (hex) for what a command with this key creates; `parts` name which thing."""
    digest = hashlib.sha256("\x1f".join((key, *parts)).encode()).hexdigest()
    return digest[:length]


class IdempotencyCache:
    """Responses of keyed commands, by (scope, method, path, key), bounded by bytes.

    Each entry is charged its key, its request fingerprint and, once answered, its response body,
    so a client sending large bodies under fresh keys evicts old entries instead of growing the
    gateway. An evicted key is still safe to retry: the ids a command derives from its key make
    the repeated append a duplicate, and creation answers the stored rollout (see `api/rollouts.py`).
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._entries: ByteLRU[tuple[str, ...], tuple[str, asyncio.Future[Result]]] = ByteLRU(max_bytes, _entry_size)
        self._shared: KeyValue | None = None

    async def share(self, js: JetStreamContext, ttl_s: float = SHARED_TTL_S) -> None:
        """Keep each key's request fingerprint in JetStream too, so every gateway process sees it."""
        try:
            self._shared = await js.key_value(BUCKET)
        except nats.js.errors.BucketNotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                await js.create_key_value(bucket=BUCKET, ttl=ttl_s, history=1)
            self._shared = await js.key_value(BUCKET)

    async def _claim(self, scope: tuple[str, ...], fingerprint: str) -> str | bool:
        """Record the key's fingerprint for all processes; 409 when another process used it for another body.

        Returns the shared key when this call created it (to withdraw if the command fails), True
        when the key was already used for this request (by another process, or before a restart),
        False when nothing is shared.
        """
        if self._shared is None:
            return False
        key = derive_id("\x1f".join(scope), "idempotency", length=64)
        try:
            await self._shared.create(key, fingerprint.encode())
            return key
        except nats.js.errors.KeyWrongLastSequenceError:
            entry = await self._shared.get(key)
            if entry.value is not None and entry.value.decode() != fingerprint:
                raise ApiError(
                    409, "this Idempotency-Key was already used with a different request; use a fresh key"
                ) from None
            return True

    @property
    def bytes(self) -> int:
        """Bytes held now (what the bound applies to)."""
        return self._entries.bytes

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self,
        scope: tuple[str, ...],
        fingerprint: str,
        command: Callable[[], Awaitable[Result]],
        recall: Recall | None = None,
    ) -> Result:
        """Run `command` once per key; repeats (same body) get the first successful result.

        A repeat this process has no answer for (the first ran in another process, or before a
        restart) is asked of `recall` first: a command whose append JetStream would no longer
        take for a duplicate (past its window) finds what the first one wrote, instead of writing
        it again.
        """
        entry = self._entries.get(scope)
        if entry is not None:
            if entry[0] != fingerprint:
                raise ApiError(409, "this Idempotency-Key was already used with a different request; use a fresh key")
            return await asyncio.shield(entry[1])
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._entries.put(scope, (fingerprint, future))
        claimed: str | bool = False
        try:
            claimed = await self._claim(scope, fingerprint)
            recalled = await recall() if claimed is True and recall is not None else None
            result = recalled if recalled is not None else await command()
        except BaseException as exc:
            # A failed command is not remembered: the retry runs again (and the derived event
            # ids still make any append that did land a duplicate).
            self._entries.pop(scope)
            await self._withdraw(claimed)
            future.set_exception(exc)
            future.exception()
            raise
        future.set_result(result)
        if result[0] >= 300:
            self._entries.pop(scope)
            await self._withdraw(claimed)
        else:
            self._entries.resize(scope)  # now charged its response too
        return result

    async def _withdraw(self, claimed: str | bool) -> None:
        if isinstance(claimed, str) and self._shared is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._shared.delete(claimed)


def _entry_size(entry: tuple[str, asyncio.Future[Result]]) -> int:
    fingerprint, future = entry
    body = len(future.result()[1]) if future.done() and not future.exception() else 0
    return len(fingerprint) + body
