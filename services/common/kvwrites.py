"""The event store's writes outside its stream: key-value entries, over the same pipelined publishes.

`PublishPipeline` is the part of `EventStore` that owns its `PipelinedAcks` (made on the first
publish, failed as a whole when the connection drops) and the key-value writes the gateway makes on
its hot path (budget entries, call markers): each is one pipelined publish, not nats-py's
`KeyValue` round trip with its JSON ack.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import nats.errors
from nats.aio.client import Client as NATS

from services.common.jspublish import PipelinedAcks
from services.common.storeerrors import NotSent


class PublishPipeline:
    """Pipelined publishes on `nc` and the key-value writes made with them (see the module docstring)."""

    nc: NATS
    _pipeline: PipelinedAcks | None = None

    @property
    def _acks(self) -> PipelinedAcks:
        if self._pipeline is None:
            self._pipeline = PipelinedAcks(self.nc)
        return self._pipeline

    def _connection_dropped(self) -> None:
        if self._pipeline is not None:
            self._pipeline.connection_dropped()

    def _not_sent(self, subject: str) -> NotSent:
        return NotSent(f"NATS is disconnected: {subject} was not sent, so it is not stored; retry later")

    async def kv_write(
        self, bucket: str, key: str, value: bytes, last: int | None = None, *, delete: bool = False, timeout: float = 5
    ) -> int:
        """Put a key-value entry (with `delete`, delete it); with `last`, only if its revision is still
        `last` (0: only if it has none). Its new revision. Raises as `KeyValue.put`/`update`/`delete` do
        (`KeyWrongLastSequenceError` when it changed, nats-py's `TimeoutError`), at the cost of one
        pipelined publish (`PipelinedAcks.kv_send`); `NotSent` while NATS is disconnected."""
        return await (await self.kv_send(bucket, key, value, last, delete=delete, timeout=timeout))

    async def kv_send(
        self, bucket: str, key: str, value: bytes, last: int | None = None, *, delete: bool = False, timeout: float = 5
    ) -> Awaitable[int]:
        """`kv_write` in two steps: send the write now, and return what awaits its outcome (await it
        always), so that the caller can work while it travels."""
        try:
            return await self._acks.kv_send(bucket, key, value, last, delete=delete, timeout=timeout)
        except nats.errors.OutboundBufferLimitError:
            raise self._not_sent(f"{bucket}/{key}") from None

    def kv_put_nowait(self, bucket: str, key: str, value: bytes) -> asyncio.Future[int | None] | None:
        """A key-value put sent now without a task (`PipelinedAcks.kv_put_nowait`): a future of its
        revision, None when it was not stored; None when it cannot be sent so (use `kv_write`)."""
        if self._pipeline is None:
            return None
        return self._pipeline.kv_put_nowait(bucket, key, value)

    async def kv_remove(self, bucket: str, key: str, revision: int) -> Awaitable[bool]:
        """Send the erasure of a key-value entry at `revision` (`PipelinedAcks.kv_remove`) and return what
        awaits it (True: erased; False: that revision was gone); `NotSent` while NATS is disconnected."""
        try:
            return await self._acks.kv_remove(bucket, key, revision)
        except nats.errors.OutboundBufferLimitError:
            raise self._not_sent(f"{bucket}/{key}@{revision}") from None
