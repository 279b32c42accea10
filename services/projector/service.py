"""The projector service: a durable JetStream consumer folding every event into Postgres.

Two tasks share a bounded backlog (`backlog.py`). The fetcher pulls batches from the durable
consumer and prepares them (decode, pack, flag); when the backlog holds `queue_batches` batches or
`queue_bytes` bytes it stops pulling, so memory stays bounded and the rest waits in JetStream. The
writer takes what is queued (coalescing batches into one transaction when it is behind), applies
it exactly once (`pgstore`) and only then acknowledges the last message (`AckPolicy.ALL`
acknowledges everything before it too). While a batch commits, the writer folds the next one
against its plan on a second connection, so the fold's CPU overlaps Postgres's work; that plan is
used only if the batch committed exactly as planned, otherwise the next batch is folded afresh.

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
from services.common.eventstore import EventStore, EventStoreUnavailable, raise_if_cancelling
from services.common.outage import Outage
from services.common.retry import Backoff, retry_async
from services.projector import pgstore
from services.projector.backlog import Backlog
from services.projector.incoming import Incoming, prepare
from services.projector.migrate import MigrationError, migrate
from services.projector.packing import PromptCache
from services.projector.refs import RefCache
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
    batch_size: int = 1000
    max_coalesce: int = 4000
    queue_batches: int = 8
    queue_bytes: int = 64 << 20
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
        self.prompts = PromptCache()
        self.refs = RefCache()
        self.store: EventStore | None = None
        self.conn: asyncpg.Connection | None = None
        self.reading: asyncpg.Connection | None = None  # folds the next batch while one commits
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
            for conn in (self.conn, self.reading):
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), 2.0)
            if self.store is not None:
                await self.store.close()

    async def _watch_stop(self) -> None:
        await self.stop.wait()
        if self._stop_since is None:
            self._stop_since = time.monotonic()

    def _draining_too_long(self) -> bool:
        return self._stop_since is not None and time.monotonic() - self._stop_since > self.settings.drain_timeout_s

    async def _retry(self, what: str, action: Callable[[], Awaitable[T]], *, drain: bool = False) -> T:
        """Run `action` until it succeeds, with capped exponential backoff (`services.common.retry`).

        Raises _Stopped once the service is stopping, except for `drain` actions, which keep
        trying for `drain_timeout_s` after the stop so that a fetched batch is stored if it can be.
        """

        async def attempt() -> T:
            if self.stop.is_set():
                if self._stop_since is None:
                    self._stop_since = time.monotonic()
                if not drain or self._draining_too_long():
                    raise _Stopped
            return await action()

        outage = Outage(log, "NATS or Postgres")  # one line when retries start, one when they end

        def note(exc: BaseException, delay: float) -> None:
            self.status.last_error = f"{what}: {type(exc).__name__}: {exc}"
            outage.failed(exc, what)

        async def pause(delay: float) -> None:  # a stop ends the wait early
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)

        done = await retry_async(
            attempt,
            backoff=Backoff(initial=0.1, maximum=self.settings.max_backoff_s, jitter=0.2),
            transient=(Exception,),
            # MigrationError: a schema this binary must not write into; waiting cannot fix it.
            permanent=(_Resync, _Stopped, pgstore.PositionMoved, MigrationError),
            on_retry=note,
            sleep=pause,
        )
        outage.ok()
        return done

    async def _connect_nats(self) -> EventStore:
        return await EventStore.connect(self.settings.nats_url, stream=self.settings.stream, name="rollwire-projector")

    async def _connect_pg(self) -> None:
        if self.conn is not None and not self.conn.is_closed():
            return
        self.conn = None
        try:
            conn = await asyncpg.connect(self.settings.database_url, timeout=5.0)
        except BaseException:
            self.status.postgres_up = False
            raise
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
        queue: Backlog[tuple[list[Incoming], Msg]] = Backlog(self.settings.queue_batches, self.settings.queue_bytes)
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

    async def _fetch_loop(self, psub: Any, queue: Backlog[tuple[list[Incoming], Msg]]) -> None:
        idle = False
        delay = 0.1
        while not self.stop.is_set():
            try:
                if idle:  # one message at a time returns the moment one arrives
                    msgs = await psub.fetch(1, timeout=1.0)
                else:
                    msgs = await psub.fetch(self.settings.batch_size, timeout=self.settings.linger_s)
            except (TimeoutError, nats.errors.TimeoutError):
                raise_if_cancelling()
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
            if self.store is not None:
                await self.refs.prime(self.store, msgs)
            items = prepare(msgs, self.detok, self.prompts, self.refs)
            self.status.fetched(items[-1].seq, items[0].stream_time)
            await queue.put((items, msgs[-1]), sum(len(msg.data) for msg in msgs))

    async def _write_loop(
        self, queue: Backlog[tuple[list[Incoming], Msg]], fetcher: asyncio.Task[None], expected: int
    ) -> None:
        """Apply batches in order; while one commits, fold the next against its plan (see pgstore)."""
        batch = await self._next_batch(queue, fetcher, expected)
        plan: pgstore.Plan | None = None
        while batch is not None:
            items, last_msg = batch
            folded: asyncio.Future[pgstore.Plan | None] = asyncio.get_running_loop().create_future()
            committing = asyncio.create_task(self._apply(items, expected, plan, folded))
            try:
                upcoming = await self._batch_during(queue, committing)
                ahead = None
                if upcoming is not None and not committing.done():
                    ahead = await self._fold_ahead(upcoming[0], folded, committing)
                applied = await committing
            finally:
                if not committing.done():  # leaving on an error: nothing half-done may stay behind
                    committing.cancel()
                    with contextlib.suppress(BaseException):
                        await committing
                    if self.conn is not None:
                        self.conn.terminate()
                        self.conn = None
            expected = applied.position
            with contextlib.suppress(Exception):
                await last_msg.ack()
            # The plan folded ahead holds only if this batch was applied exactly as its plan said.
            plan = ahead[1] if ahead is not None and applied.plan is ahead[0] else None
            batch = upcoming if upcoming is not None else await self._next_batch(queue, fetcher, expected)

    def _coalesce(self, queue: Backlog[tuple[list[Incoming], Msg]], first: tuple[list[Incoming], Msg]) -> Any:
        items, last_msg = first
        while queue and len(items) < self.settings.max_coalesce:
            more = queue.get_nowait()
            if more is None:
                break
            items, last_msg = items + more[0], more[1]
        return items, last_msg

    async def _next_batch(
        self, queue: Backlog[tuple[list[Incoming], Msg]], fetcher: asyncio.Task[None], expected: int
    ) -> tuple[list[Incoming], Msg] | None:
        """The next coalesced batch; None once the fetcher has stopped and everything is applied."""
        while True:
            if fetcher.done() and not queue:
                exc = fetcher.exception() if not fetcher.cancelled() else None
                if exc is not None:
                    raise exc
                return None
            try:
                async with asyncio.timeout(1.0):  # not wait_for: on 3.11 it can lose a cancel
                    first = await queue.get()
            except TimeoutError:
                await self._idle_check(expected)
                continue
            return self._coalesce(queue, first)

    async def _batch_during(
        self, queue: Backlog[tuple[list[Incoming], Msg]], committing: asyncio.Task[Any]
    ) -> tuple[list[Incoming], Msg] | None:
        """A batch that arrives while `committing` runs (None if it finishes first)."""
        if not queue:
            getting = asyncio.ensure_future(queue.get())
            await asyncio.wait({getting, committing}, return_when=asyncio.FIRST_COMPLETED)
            if not getting.done():
                getting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await getting
                return None
            return self._coalesce(queue, getting.result())
        first = queue.get_nowait()
        assert first is not None
        return self._coalesce(queue, first)

    async def _fold_ahead(
        self,
        items: list[Incoming],
        folded: asyncio.Future[pgstore.Plan | None],
        committing: asyncio.Task[pgstore.Applied],
    ) -> tuple[pgstore.Plan, pgstore.Plan] | None:
        """Fold `items` against the plan being committed, on a reading connection; None if unable."""
        waiting: set[asyncio.Future[Any]] = {folded, committing}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        prior = folded.result() if folded.done() else None
        if prior is None:
            return None
        try:
            if self.reading is None or self.reading.is_closed():
                self.reading = await asyncpg.connect(self.settings.database_url, timeout=5.0)
            ahead = await pgstore.plan_batch(self.reading, items, prior.last_seq, prior)
        except Exception as exc:  # only an optimisation: the batch is folded again when applied
            log.debug("could not fold ahead: %s", exc)
            return None
        return (prior, ahead) if ahead is not None else None

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

    async def _apply(
        self,
        items: list[Incoming],
        expected: int,
        plan: pgstore.Plan | None = None,
        folded: asyncio.Future[pgstore.Plan | None] | None = None,
    ) -> pgstore.Applied:
        """Apply a batch: commit its ready `plan` if there is one, else fold and apply it afresh.

        `folded` receives the plan being applied as soon as it exists (the first one only: a plan
        folded by a retry is not announced, so nothing is folded against a plan that may not hold).
        """
        started = time.perf_counter()

        def announce(ready: pgstore.Plan | None) -> None:
            if folded is not None and not folded.done():
                folded.set_result(ready)

        async def attempt() -> pgstore.Applied:
            nonlocal plan
            await self._connect_pg()
            assert self.conn is not None
            try:
                if plan is not None:
                    ready, plan = plan, None  # a failed commit is retried by folding afresh
                    announce(ready)
                    return await pgstore.commit(self.conn, self.settings.stream, ready, expected)
                return await pgstore.apply_isolating(self.conn, self.settings.stream, items, expected, announce)
            except PG_CONNECTION_ERRORS:
                self.status.postgres_up = False
                with contextlib.suppress(Exception):
                    self.conn.terminate()
                raise

        try:
            applied = await self._retry("apply a batch", attempt, drain=True)
        except pgstore.PositionMoved as moved:
            log.info("%s", moved)
            self.status.applied_seq = moved.stored
            raise _Resync from None
        finally:
            announce(None)
        if applied.dead:
            log.warning("%d event(s) up to seq %d recorded as dead letters", applied.dead, applied.position)
        self.status.dead_letters += applied.dead
        self.status.applied(
            applied.position, sum(1 for item in items if item.seq > expected), time.perf_counter() - started
        )
        return applied

    # ---- metrics ----------------------------------------------------------------------------

    async def _refresh_loop(self) -> None:
        """Twice a second: read the stream's last sequence and compute the lag; NATS down shows within 1 s."""
        assert self.store is not None
        js = self.store.js
        while True:
            if not self.store.nc.is_connected:  # flips as soon as the connection drops
                self.status.nats_up = False
                await asyncio.sleep(0.25)
                continue
            try:
                async with asyncio.timeout(1.0):
                    info = await js.stream_info(self.settings.stream)
                self.status.stream_seq = int(info.state.last_seq)
                self.status.nats_up = True
                self.status.lag_seconds = await self._lag_seconds(js)
            except (TimeoutError, nats.errors.Error, OSError, EventStoreUnavailable):
                self.status.nats_up = False
            await asyncio.sleep(0.5)

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
