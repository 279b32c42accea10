"""The projector service: a durable JetStream consumer folding every event into Postgres.

Two tasks share a bounded queue. The fetcher pulls batches from the durable consumer and
prepares them (decode, pack, flag); when the queue is full it stops pulling, so memory is
bounded by `queue_batches` x `batch_size` messages and the rest waits in JetStream. The writer
takes what is queued (coalescing several batches into one transaction when it is behind), applies
it exactly once (`pgstore.apply_isolating`) and only then acknowledges the last message
(`AckPolicy.ALL` acknowledges everything before it too).

Postgres is the source of truth for the position, not the consumer: on start, and whenever the
stored position is not where this process left it (a rebuild, another projector), the durable
consumer is recreated to deliver from the stored sequence + 1. When Postgres is down the writer
retries the same batch with backoff and acknowledges nothing; when NATS is down the fetcher
retries. One projector writes at a time (a Postgres advisory lock); a second one stands by.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas.ids import STREAM_NAME, STREAM_SUBJECTS
from services.eventstore import EventStore, EventStoreUnavailable
from services.projector import pgstore
from services.projector.incoming import Incoming, prepare
from services.projector.migrate import migrate
from services.projector.status import Status
from services.projector.tokens import Detokenizer

log = logging.getLogger("rollwire.projector")
T = TypeVar("T")

PG_CONNECTION_ERRORS = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
)


class ProjectorSettings(msgspec.Struct, kw_only=True):
    """How the projector connects and batches (see `python -m services.projector --help`)."""

    nats_url: str
    database_url: str
    stream: str = STREAM_NAME
    durable: str = "rollwire-projector"
    batch_size: int = 500
    max_coalesce: int = 2000
    queue_batches: int = 4
    linger_s: float = 0.05
    ack_wait_s: float = 60.0
    max_backoff_s: float = 5.0
    drain_timeout_s: float = 15.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    tokenizers: list[str] = []


class _Stopped(Exception):
    """The service was asked to stop while waiting."""


class _Resync(Exception):
    """The consumer must be recreated from the stored position."""


class Projector:
    """One projector process: `await Projector(settings).run(stop)` until `stop` is set."""

    def __init__(self, settings: ProjectorSettings, detok: Detokenizer | None = None) -> None:
        self.settings = settings
        self.detok = detok if detok is not None else Detokenizer.from_specs(settings.tokenizers)
        self.status = Status(settings.stream)
        self.store: EventStore | None = None
        self.conn: asyncpg.Connection | None = None
        self.stop = asyncio.Event()
        self._stop_since: float | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Project until `stop` is set, then drain what is fetched and return."""
        if stop is not None:
            self.stop = stop
        watcher = asyncio.create_task(self._watch_stop())
        refresher: asyncio.Task[None] | None = None
        try:
            self.store = await self._retry("connect to NATS", self._connect_nats)
            self.status.nats_up = True
            await self._retry("connect to Postgres", self._connect_pg)
            refresher = asyncio.create_task(self._refresh_loop())
            while not self.stop.is_set():
                try:
                    await self._session()
                except _Resync:
                    self.status.reset_in_flight()
                    continue
        except _Stopped:
            pass
        finally:
            watcher.cancel()
            if refresher is not None:
                refresher.cancel()
            if self.conn is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.conn.close(), 2.0)
            if self.store is not None:
                await self.store.close()

    async def _watch_stop(self) -> None:
        await self.stop.wait()
        if self._stop_since is None:
            self._stop_since = time.monotonic()

    def _draining_too_long(self) -> bool:
        return self._stop_since is not None and time.monotonic() - self._stop_since > self.settings.drain_timeout_s

    async def _retry(self, what: str, action: Callable[[], Awaitable[T]], *, drain: bool = False) -> T:
        """Run `action` until it succeeds, with capped exponential backoff.

        Raises _Stopped once the service is stopping, except for `drain` actions, which keep
        trying for `drain_timeout_s` after the stop so that a fetched batch is stored if it can be.
        """
        delay = 0.1
        while True:
            if self.stop.is_set():
                if self._stop_since is None:
                    self._stop_since = time.monotonic()
                if not drain or self._draining_too_long():
                    raise _Stopped
            try:
                return await action()
            except (_Resync, _Stopped, pgstore.PositionMoved):
                raise
            except Exception as exc:
                self.status.last_error = f"{what}: {type(exc).__name__}: {exc}"
                log.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
            delay = min(self.settings.max_backoff_s, delay * 2) * (0.8 + 0.4 * random.random())

    async def _connect_nats(self) -> EventStore:
        return await EventStore.connect(self.settings.nats_url, stream=self.settings.stream, name="rollwire-projector")

    async def _connect_pg(self) -> None:
        if self.conn is not None and not self.conn.is_closed():
            return
        self.conn = None
        conn = await asyncpg.connect(self.settings.database_url, timeout=5.0)
        try:
            await migrate(conn)
            while not await conn.fetchval(
                "SELECT pg_try_advisory_lock(hashtext('rollwire-projector:' || $1))", self.settings.stream
            ):
                log.info("another projector holds the lock for %s; standing by", self.settings.stream)
                self.status.last_error = "standing by: another projector is active"
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 1.0)
                if self.stop.is_set():
                    raise _Stopped
            self.status.applied_seq = await pgstore.ensure_position(conn, self.settings.stream)
            self.status.dead_letters = await pgstore.dead_letter_count(conn)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close()
            raise
        self.conn = conn
        self.status.postgres_up = True

    # ---- one consumer session ----------------------------------------------------------------

    async def _session(self) -> None:
        assert self.store is not None
        await self._retry("connect to Postgres", self._connect_pg)
        expected = self.status.applied_seq
        psub = await self._retry("create the durable consumer", lambda: self._open_consumer(expected))
        queue: asyncio.Queue[tuple[list[Incoming], Msg]] = asyncio.Queue(maxsize=self.settings.queue_batches)
        fetcher = asyncio.create_task(self._fetch_loop(psub, queue))
        try:
            await self._write_loop(queue, fetcher, expected)
        finally:
            fetcher.cancel()
            with contextlib.suppress(BaseException):
                await fetcher
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def _open_consumer(self, after_seq: int) -> Any:
        """(Re)create the durable consumer so it delivers from `after_seq + 1`."""
        assert self.store is not None
        js, name, stream = self.store.js, self.settings.durable, self.settings.stream
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_consumer(stream, name)
        config = ConsumerConfig(
            durable_name=name,
            description="Rollwire projector (position kept in Postgres)",
            ack_policy=AckPolicy.ALL,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if after_seq else DeliverPolicy.ALL,
            opt_start_seq=after_seq + 1 if after_seq else None,
            filter_subject=STREAM_SUBJECTS,
            ack_wait=self.settings.ack_wait_s,
            max_ack_pending=max(10_000, self.settings.batch_size * (self.settings.queue_batches + 2)),
        )
        await js.add_consumer(stream, config)
        return await js.pull_subscribe_bind(durable=name, stream=stream)

    async def _fetch_loop(self, psub: Any, queue: asyncio.Queue[tuple[list[Incoming], Msg]]) -> None:
        idle = False
        delay = 0.1
        while not self.stop.is_set():
            try:
                if idle:  # one message at a time returns the moment one arrives
                    msgs = await psub.fetch(1, timeout=1.0)
                else:
                    msgs = await psub.fetch(self.settings.batch_size, timeout=self.settings.linger_s)
            except (TimeoutError, nats.errors.TimeoutError):
                idle = True
                continue
            except nats.js.errors.NotFoundError:
                raise _Resync from None
            except (nats.errors.Error, OSError) as exc:
                self.status.nats_up = False
                self.status.last_error = f"fetch: {type(exc).__name__}: {exc}"
                await asyncio.sleep(delay)
                delay = min(self.settings.max_backoff_s, delay * 2)
                continue
            delay = 0.1
            self.status.nats_up = True
            idle = False
            if not msgs:
                continue
            items = prepare(msgs, self.detok)
            self.status.fetched(items[-1].seq, items[0].stream_time)
            await queue.put((items, msgs[-1]))

    async def _write_loop(
        self, queue: asyncio.Queue[tuple[list[Incoming], Msg]], fetcher: asyncio.Task[None], expected: int
    ) -> None:
        while True:
            if fetcher.done() and queue.empty():
                exc = fetcher.exception() if not fetcher.cancelled() else None
                if exc is not None:
                    raise exc
                return
            try:
                items, last_msg = await asyncio.wait_for(queue.get(), 1.0)
            except TimeoutError:
                await self._idle_check(expected)
                continue
            while not queue.empty() and len(items) < self.settings.max_coalesce:
                more, last_msg = queue.get_nowait()
                items = items + more
            expected = await self._apply(items, expected)
            with contextlib.suppress(Exception):
                await last_msg.ack()

    async def _idle_check(self, expected: int) -> None:
        """Notice a rebuild (the stored position moved) while no events arrive."""

        async def check() -> None:
            assert self.conn is not None
            await self._connect_pg()
            stored = await self.conn.fetchval(
                "SELECT last_seq FROM projector_position WHERE stream = $1", self.settings.stream
            )
            if stored is not None and stored != expected:
                log.info("stored position moved to %s (expected %s): resuming from it", stored, expected)
                self.status.applied_seq = int(stored)
                raise _Resync

        await self._retry("check the stored position", check)

    async def _apply(self, items: list[Incoming], expected: int) -> int:
        started = time.perf_counter()

        async def attempt() -> tuple[int, int]:
            await self._connect_pg()
            assert self.conn is not None
            try:
                return await pgstore.apply_isolating(self.conn, self.settings.stream, items, expected)
            except PG_CONNECTION_ERRORS:
                self.status.postgres_up = False
                with contextlib.suppress(Exception):
                    self.conn.terminate()
                raise

        try:
            position, dead = await self._retry("apply a batch", attempt, drain=True)
        except pgstore.PositionMoved as moved:
            log.info("%s", moved)
            self.status.applied_seq = moved.stored
            raise _Resync from None
        if dead:
            log.warning("%d event(s) up to seq %d recorded as dead letters", dead, position)
        self.status.dead_letters += dead
        self.status.applied(position, sum(1 for item in items if item.seq > expected), time.perf_counter() - started)
        return position

    # ---- metrics ----------------------------------------------------------------------------

    async def _refresh_loop(self) -> None:
        """Every second: read the stream's last sequence and compute the lag in seconds."""
        assert self.store is not None
        js = self.store.js
        while True:
            try:
                info = await js.stream_info(self.settings.stream)
                self.status.stream_seq = int(info.state.last_seq)
                self.status.nats_up = True
                self.status.lag_seconds = await self._lag_seconds(js)
            except (TimeoutError, nats.errors.Error, OSError, EventStoreUnavailable):
                self.status.nats_up = False
            await asyncio.sleep(1.0)

    async def _lag_seconds(self, js: Any) -> float:
        if self.status.lag_events == 0:
            return 0.0
        oldest = self.status.oldest_unapplied_time()
        if oldest is None:
            try:
                raw = await js.get_msg(
                    self.settings.stream, seq=self.status.applied_seq + 1, subject=STREAM_SUBJECTS, next=True
                )
            except nats.js.errors.NotFoundError:
                return 0.0
            if raw.time is None:
                return 0.0
            oldest = raw.time.timestamp()
        return max(0.0, time.time() - oldest)
