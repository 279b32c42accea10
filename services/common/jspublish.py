"""JetStream connection plumbing under the event store: the connect probe, nats-py's connection
callbacks (one log line per outage, an optional reconnect buffer) and pipelined publishes whose
acks, refusals included, all complete (`PipelinedAcks`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlparse

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.deadline import fail_after, within
from services.common.natswire import NatsWire, WireError
from services.common.outage import Outage

log = logging.getLogger("rollwire.eventstore")
ERASED_TTL = "1s"
"""How long a key-value entry erased by `PipelinedAcks.kv_remove` leaves its delete marker (JetStream's
shortest message TTL)."""


async def probe(url: str, timeout: float) -> bool:
    """True when something accepts TCP connections at one of the URLs' host:port."""
    for one in url.split(","):
        parsed = urlparse(one.strip() if "://" in one else f"nats://{one.strip()}")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout
            )
        except (TimeoutError, OSError):
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True
    return False


def connection_options(
    holder: list[NATS], name: str, buffered: bool, on_drop: Sequence[Callable[[], None]] = ()
) -> dict[str, Any]:
    """nats-py's connection callbacks: one log line per outage and one on recovery, and with
    `buffered=False` no reconnect buffer (see `EventStore.connect`); `holder` gets the client, and
    each of `on_drop` (a list the caller may fill after connecting) runs when the connection drops.

    nats-py's default error callback logs a traceback for every failed reconnect attempt (two a
    second with our reconnect wait): an outage is logged once by `Outage` instead."""
    outage = Outage(log, f"NATS ({name})")

    async def on_error(exc: Exception) -> None:
        outage.failed(exc, "reconnecting")

    async def on_disconnect() -> None:
        if holder and holder[0].is_closed:
            return  # closed on purpose (`close()` calls this too): no outage to report
        if not buffered and holder and isinstance(getattr(holder[0], "_pending", None), list):
            # Called once the socket is closed and before the reconnect, which would send what was
            # queued but not written (nats-py keeps it in `_pending`): that is dropped here.
            holder[0]._pending = []
            holder[0]._pending_data_size = 0
        for dropped in on_drop:
            dropped()
        outage.failed(ConnectionError("the connection dropped"), "reconnecting")

    async def on_reconnect() -> None:
        outage.ok()

    options: dict[str, Any] = {"error_cb": on_error, "disconnected_cb": on_disconnect, "reconnected_cb": on_reconnect}
    if not buffered:
        options["pending_size"] = 0
    return options


class PubAck(msgspec.Struct):
    """JetStream's answer to a publish: its sequence and duplicate flag, or an error."""

    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_decode_ack = msgspec.json.Decoder(PubAck).decode


Ack = tuple[int, bool]
"""A publish's stream sequence and whether it was a duplicate."""


async def _removed(pending: Awaitable[int]) -> bool:
    """A key-value erasure's outcome: False when the entry was no longer at the revision it named."""
    try:
        await pending
    except nats.js.errors.KeyWrongLastSequenceError:
        return False
    return True


def _no_ack() -> TimeoutError:
    return TimeoutError("no ack from JetStream in time")


class PipelinedAcks:
    """Pipelined publishes and their acks, read from one reply subscription of our own.

    nats-py's `publish_async` never completes a publish JetStream refuses (its reply handler raises
    the error instead of setting it on the future), so an append refused for a full store hung for
    the whole ack timeout. Here every answer completes its future, the refusals with `APIError`.

    The publishes and acks travel on a lean second connection (`natswire.NatsWire`) where one can be
    made, else on nats-py's. A lost lean connection (NATS restarted, say) is made again by the next
    publish once nats-py is connected again; one that could not be made at all is not tried again.
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = ""
        self.waiting: dict[str, asyncio.Future[Ack]] = {}
        self.sent = 0
        self.ready: asyncio.Future[None] | None = None
        self.wire: NatsWire | None = None
        self._subscribed = False

    async def send(self, subject: str, data: bytes, headers: dict[str, str] | None) -> tuple[str, asyncio.Future[Ack]]:
        """Publish one message: (its token, a future completed with its ack or JetStream's error).

        Disconnected, it raises `OutboundBufferLimitError` at once rather than queue the message for
        a reconnect: a caller answered "not stored" must never see it stored later."""
        if not self.nc.is_connected:
            raise nats.errors.OutboundBufferLimitError
        if self.ready is None:
            self.ready = asyncio.ensure_future(self._connect())
        ready = self.ready
        if not ready.done():
            await asyncio.shield(ready)
        if ready.cancelled() or ready.exception() is not None:  # tried again on the next publish
            self.ready = None
            ready.result()
        if self.wire is not None and self.wire.connected:
            sent = self._publish_now(subject, data, headers)
            if sent is None:  # closed in this instant: not sent, as while disconnected
                raise nats.errors.OutboundBufferLimitError
            return sent
        token, future = self._waiter()
        try:
            await self.nc.publish(subject, data, reply=self.prefix + token, headers=headers)
        except BaseException:
            self.waiting.pop(token, None)
            raise
        return token, future

    def _waiter(self) -> tuple[str, asyncio.Future[Ack]]:
        """A new publish's reply token and the future its ack completes."""
        self.sent += 1
        token = str(self.sent)
        future: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        self.waiting[token] = future
        return token, future

    def _publish_now(
        self, subject: str, data: bytes, headers: dict[str, str] | None
    ) -> tuple[str, asyncio.Future[Ack]] | None:
        """Publish on the lean connection without awaiting anything; None when it is not up."""
        wire = self.wire
        if wire is None or not wire.connected:
            return None
        token, future = self._waiter()
        try:
            wire.publish(subject, self.prefix + token, data, headers)
        except WireError:
            self.waiting.pop(token, None)
            return None
        except BaseException:
            self.waiting.pop(token, None)
            raise
        return token, future

    async def _connect(self) -> None:
        """The lean connection where one can be made, else a subscription for the replies on nats-py's."""
        if not self.prefix:
            self.prefix = f"{self.nc.new_inbox()}."
        url = self.nc.connected_url
        if url is not None:
            name = f"{self.nc.options.get('name') or 'rollwire'} (publishes)"
            try:
                self.wire = await NatsWire.open(
                    url, f"{self.prefix}*", self._deliver, self._lost, name=name, timeout=2.0
                )
                return
            except WireError as exc:
                log.debug("publishing through nats-py: %s", exc)
        if not self._subscribed:
            await self.nc.subscribe(f"{self.prefix}*", cb=self._answer)
            self._subscribed = True

    def _lost(self, wire: NatsWire) -> None:
        if wire is self.wire:  # not an older one, closed after it was replaced
            self.connection_dropped()

    async def request(self, subject: str, data: bytes, headers: dict[str, str], timeout: float) -> Ack:
        """Publish one message and wait for its ack (raises JetStream's refusal as `APIError`,
        `TimeoutError` when none comes in `timeout` seconds).

        The hot path's single publishes (an event, a key-value compare-and-set): nats-py's
        `js.publish` costs a `wait_for`, a `json.loads` and a dataclass per ack; this shares the one
        reply subscription and decodes the ack with msgspec."""
        token, future = await self.send(subject, data, headers)
        try:
            return await within(future, timeout, _no_ack)
        finally:
            self.forget([token], [future])

    async def kv_send(
        self,
        bucket: str,
        key: str,
        value: bytes,
        last: int | None = None,
        *,
        delete: bool = False,
        ttl: str | None = None,
        timeout: float = 5,
    ) -> Awaitable[int]:
        """Send a key-value write (a delete with `delete`; with `last`, a compare-and-set on the entry's
        revision; with `ttl`, a message that expires, `Nats-TTL`) and return what awaits its new
        revision, raising as nats-py's `KeyValue` does."""
        headers = {} if last is None else {"Nats-Expected-Last-Subject-Sequence": str(last)}
        if delete:
            headers["KV-Operation"] = "DEL"
        if ttl is not None:
            headers["Nats-TTL"] = ttl
        token, future = await self.send(f"$KV.{bucket}.{key}", value, headers)
        return self._kv_ack(token, future, timeout)

    def kv_put_nowait(
        self, bucket: str, key: str, value: bytes, *, timeout: float = 5
    ) -> asyncio.Future[int | None] | None:
        """A key-value put sent now, without a task, on the lean connection: a future of its revision
        (None when it was not stored or no ack came in `timeout` seconds). None when the lean
        connection is not up: use `kv_send`. For a write made on every call (the call's marker), where
        a task and its chain of coroutines cost more than the write."""
        sent = self._publish_now(f"$KV.{bucket}.{key}", value, None) if self.nc.is_connected else None
        if sent is None:
            return None
        token, ack = sent
        revision: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        timer = fail_after(ack, timeout, _no_ack)

        def acked(done: asyncio.Future[Ack]) -> None:
            timer.cancel()
            stored = not done.cancelled() and done.exception() is None
            self.forget([token], [done])
            if not revision.done():
                revision.set_result(done.result()[0] if stored else None)

        ack.add_done_callback(acked)
        return revision

    async def _kv_ack(self, token: str, future: asyncio.Future[Ack], timeout: float) -> int:
        try:
            seq, _ = await within(future, timeout, _no_ack)
        except nats.js.errors.APIError as exc:
            if exc.err_code in (10071, 10164):  # the stream's wrong-last-sequence errors
                raise nats.js.errors.KeyWrongLastSequenceError(description=exc.description) from None
            raise
        except nats.errors.Error:
            raise
        except TimeoutError:
            raise nats.errors.TimeoutError() from None
        except ValueError as exc:  # an ack that is not one
            raise nats.errors.Error(str(exc)) from None
        finally:
            self.forget([token], [future])
        return seq

    async def kv_remove(self, bucket: str, key: str, revision: int, *, timeout: float = 5) -> Awaitable[bool]:
        """Send the erasure of the key-value entry `key` stored at `revision` and return what awaits its
        outcome: True when it was erased, False when that revision was no longer the entry's (changed or
        erased since).

        A delete marker written only if the entry is still at `revision`, that expires a second later
        (`Nats-TTL`; the bucket's stream must allow it, `allow_msg_ttl`): the bucket soon holds only
        live entries, and the erasure takes JetStream's publish path (its API's message delete, which
        leaves nothing at all, took 183 µs a round trip against a publish's 127)."""
        pending = await self.kv_send(bucket, key, b"", revision, delete=True, ttl=ERASED_TTL, timeout=timeout)
        return _removed(pending)

    def connection_dropped(self) -> None:
        """Fail every publish still waiting for its ack, as a timeout would (it may or may not be
        stored): the ack went with the connection, and waiting out the timeout only held the callers,
        so a caller in flight when NATS died was answered seconds after the outage began."""
        wire, self.wire = self.wire, None
        if wire is not None:  # it went with nats-py's, or soon will: made again by a later publish
            wire.close()
            self.ready = None
        waiting, self.waiting = self.waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(TimeoutError("the NATS connection dropped before the ack"))

    def forget(self, tokens: list[str], futures: Sequence[asyncio.Future[Ack]] = ()) -> None:
        """Stop waiting for these (answered or abandoned); the abandoned futures' errors are dropped."""
        for token in tokens:
            self.waiting.pop(token, None)
        for future in futures:
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()

    async def _answer(self, msg: Msg) -> None:
        no_responders = msg.headers is not None and msg.headers.get("Status") == "503"
        self._deliver(msg.subject, msg.data, no_responders)

    def _deliver(self, subject: str, data: bytes, no_responders: bool) -> None:
        """Complete the waiting publish a reply answers (from either connection)."""
        future = self.waiting.pop(subject[len(self.prefix) :], None)
        if future is None or future.done():
            return
        if no_responders:
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            ack = _decode_ack(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            future.set_exception(ValueError(f"JetStream answered an append with {data[:200]!r}: {exc}"))
            return
        if ack.error is not None:
            err = ack.error
            future.set_exception(
                nats.js.errors.APIError(
                    code=err.get("code"), err_code=err.get("err_code"), description=err.get("description")
                )
            )
        else:
            future.set_result((ack.seq, ack.duplicate))

    def close(self) -> None:
        """Close the lean connection (nats-py's is closed by its owner)."""
        wire, self.wire = self.wire, None
        if wire is not None:
            wire.close()
