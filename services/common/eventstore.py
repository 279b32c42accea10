"""The event store: Rollwire's one way to append and read events on NATS JetStream.

Every service goes through this module, so the rules live in one place:

- `append` publishes with `Nats-Msg-Id = event_id`: a re-sent event inside the stream's duplicate
  window is acknowledged as a duplicate (`Appended.duplicate`), never stored twice.
- `append(..., expected_last_subject_seq=n)` adds `Nats-Expected-Last-Subject-Sequence`: if another
  writer got there first, JetStream answers error 10071 and we raise `ConcurrencyConflict`.
- A store that refuses writes for lack of room (JetStream 10023, 10047, 10077, a full disk) raises
  `StoreFull` at once, pipelined appends included, and `refusing` says why until a write succeeds.
- `connect(..., reconnect_buffer=False)`: nothing published while disconnected is sent later, so
  an append that raised `NotSent` is certainly not stored.
- Reads use ephemeral pull consumers with no acks and stop when the consumer reports nothing
  pending, so they end on an idle stream instead of waiting for new messages.

    store = await EventStore.connect("nats://127.0.0.1:4222")
    appended = await store.append(RewardReported(run_id="r1", rollout_id="x", value=1.0))
    events = await store.read_rollout("r1", "x")
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

from schemas import Event, ModelRequestRecorded, RolloutStatusChanged, check_id, decode, encode
from schemas.ids import ROLLOUT_ALL, ROLLOUT_STATUS, RUN_ALL, STREAM_NAME, STREAM_SUBJECTS
from schemas.refs import Resolver, UnresolvedReference
from services.common.jspublish import connection_options, probe
from services.common.kvwrites import PublishPipeline
from services.common.storeerrors import (
    STORE_FULL,
    WRONG_LAST_SEQUENCE,
    ConcurrencyConflict,
    EventStoreError,
    EventStoreUnavailable,
    EventTooLarge,
    NotSent,
    StoreFull,
)
from services.common.streamread import StartFrom, StoredEvent, follow, raise_if_cancelling, read_batches, to_stored

__all__ = [
    "Appended",
    "ConcurrencyConflict",
    "EventStore",
    "EventStoreError",
    "EventStoreUnavailable",
    "EventTooLarge",
    "NotSent",
    "StartFrom",
    "StoreFull",
    "StoredEvent",
    "raise_if_cancelling",
]

HEADER_ALLOWANCE = 512
"""Bytes of a message's headers and framing kept free under the server's max_payload."""
ACK_TIMEOUT_S = 30.0
"""Longest wait for JetStream's ack of a pipelined append; past it the append raises (retrying is safe)."""
PUBLISH_TIMEOUT_S = 5.0
"""How long one append waits for its ack (nats-py's `js.publish` default)."""


class Appended(msgspec.Struct, frozen=True):
    """The stream's answer to an append: its sequence and whether it was a duplicate."""

    seq: int
    duplicate: bool = False


class EventStore(PublishPipeline):
    """Append-only access to the Rollwire stream (see the module docstring for the rules)."""

    def __init__(self, nc: NATS, stream: str = STREAM_NAME, *, url: str = "") -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.stream = stream
        self.url = url
        """The URL(s) it was connected with ("" when built on a connection): where another process connects."""
        self.refusing: str | None = None
        """Why the store refuses writes (it is full), from the last refused append; None once one succeeds."""

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        stream: str = STREAM_NAME,
        timeout: float = 2.0,
        ensure: bool = True,
        replicas: int = 1,
        duplicate_window_s: float = 120.0,
        name: str = "rollwire",
        reconnect_buffer: bool = True,
    ) -> EventStore:
        """Connect (failing fast when nothing answers) and, unless `ensure=False`, ensure the stream.

        `reconnect_buffer=False` turns off nats-py's reconnect buffer: while NATS is disconnected an
        append raises `NotSent` at once, and whatever was queued but unsent when the connection
        dropped is discarded instead of sent after the reconnect. A writer that tells its caller
        "not stored" on a failed append needs that: a buffered event would otherwise be stored
        later, after the caller was told it was not (the gateway's call records).
        """
        if not await probe(url, timeout):
            raise EventStoreUnavailable(
                f"no NATS server answers at {url}: start one with `rollwire up` or point NATS_URL at a running server"
            )
        holder: list[NATS] = []
        on_drop: list[Callable[[], None]] = []
        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    url,
                    name=name,
                    connect_timeout=timeout,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    **connection_options(holder, name, reconnect_buffer, on_drop),
                ),
                timeout * 3,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise EventStoreUnavailable(f"could not connect to NATS at {url}: {exc}") from None
        holder.append(nc)
        store = cls(nc, stream, url=url)
        on_drop.append(store._connection_dropped)
        if ensure:
            try:
                await store.ensure_stream(replicas=replicas, duplicate_window_s=duplicate_window_s)
            except BaseException:
                await nc.close()
                raise
        return store

    async def ensure_stream(self, *, replicas: int = 1, duplicate_window_s: float = 120.0) -> None:
        """Create the stream (file storage, `rl.>`) or update its settings if it exists."""
        config = StreamConfig(
            name=self.stream,
            subjects=[STREAM_SUBJECTS],
            storage=StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=duplicate_window_s,
            max_msg_size=-1,
        )
        try:
            try:
                await self.js.stream_info(self.stream)
            except nats.js.errors.NotFoundError:
                await self.js.add_stream(config)
            else:
                await self.js.update_stream(config)
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
            raise EventStoreUnavailable(
                "the NATS server has no JetStream: start it with `-js` (or use `rollwire up`)"
            ) from None

    async def close(self) -> None:
        """Flush pending publishes and close the connections."""
        if self._pipeline is not None:
            self._pipeline.close()
        with contextlib.suppress(Exception):
            await self.nc.drain()

    async def __aenter__(self) -> EventStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- writing ---------------------------------------------------------------------------

    @staticmethod
    def _headers(event: Event, expected_last_subject_seq: int | None, over: str | None = None) -> dict[str, str]:
        headers = {"Nats-Msg-Id": event.event_id}
        if expected_last_subject_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_subject_seq)
        if over is not None:  # the expected sequence is of the last message matching this filter
            headers["Nats-Expected-Last-Subject-Sequence-Subject"] = over
        return headers

    async def append(
        self, event: Event, expected_last_subject_seq: int | None = None, *, encoded: bytes | None = None
    ) -> Appended:
        """Append one event (`encoded`: its `encode`d bytes, when the caller made them already); returns
        its stream sequence, or the original's when it is a duplicate."""
        subject = event.subject
        data = self._checked(subject, encode(event) if encoded is None else encoded)
        headers = {**self._headers(event, expected_last_subject_seq), "Nats-Expected-Stream": self.stream}
        try:
            seq, duplicate = await self._acks.request(subject, data, headers, PUBLISH_TIMEOUT_S)
        except nats.js.errors.APIError as exc:
            raise self._translate(exc, subject, expected_last_subject_seq) from None
        except nats.errors.OutboundBufferLimitError:
            raise self._not_sent(subject) from None
        except (TimeoutError, nats.errors.ConnectionClosedError, nats.js.errors.NoStreamResponseError):
            raise EventStoreUnavailable(
                f"JetStream did not acknowledge {subject}; the event may or may not be stored"
            ) from None
        except ValueError as exc:  # an ack that is not one
            raise EventStoreError(str(exc)) from None
        self.refusing = None
        return Appended(seq=seq, duplicate=duplicate)

    async def append_many(self, events: Iterable[Event], encoded: Sequence[bytes] | None = None) -> list[Appended]:
        """Append many events pipelined (publish all, then await every ack), in order (`encoded`: their
        `encode`d bytes, when the caller made them already).

        A refusal (a full store, a conflict) raises at once, as `append` does; events before the
        refused one may be stored. The acks are read by `_Acks`, not nats-py's `publish_async`,
        which never completes a publish JetStream refuses (it waited out the whole timeout).
        """
        events = list(events)
        datas = [encode(event) for event in events] if encoded is None else encoded
        encoded_events = [(e, self._checked(e.subject, data)) for e, data in zip(events, datas, strict=True)]
        acks = self._acks
        tokens: list[str] = []
        futures: list[asyncio.Future[tuple[int, bool]]] = []
        try:
            for event, data in encoded_events:
                headers = {**self._headers(event, None), "Nats-Expected-Stream": self.stream}
                token, future = await acks.send(event.subject, data, headers)
                tokens.append(token)
                futures.append(future)
        except nats.errors.OutboundBufferLimitError:
            acks.forget(tokens)
            raise self._not_sent(encoded_events[len(futures)][0].subject) from None
        results: list[Appended] = []
        loop = asyncio.get_running_loop()
        try:
            # One deadline for the batch, pushed back as acks arrive (a timer per ack would cost more
            # than the ack): it fires only when JetStream stops acknowledging for ACK_TIMEOUT_S.
            async with asyncio.timeout(ACK_TIMEOUT_S) as deadline:
                for i, future in enumerate(futures):
                    if i % 256 == 255:
                        deadline.reschedule(loop.time() + ACK_TIMEOUT_S)
                    try:
                        seq, duplicate = await future
                    except ValueError as exc:
                        raise EventStoreError(str(exc)) from None
                    except nats.js.errors.APIError as exc:
                        raise self._translate(exc, encoded_events[i][0].subject, None) from None
                    except nats.js.errors.NoStreamResponseError:
                        raise EventStoreUnavailable(
                            f"no JetStream stream answered for {encoded_events[i][0].subject}: is the stream there?"
                        ) from None
                    results.append(Appended(seq=seq, duplicate=duplicate))
        except TimeoutError:
            raise EventStoreUnavailable(
                f"JetStream did not acknowledge an append within {ACK_TIMEOUT_S:.0f}s; it may or may not be "
                "stored: retrying is safe (the event id makes a repeat a duplicate)"
            ) from None
        finally:
            acks.forget(tokens, futures)
        if results:
            self.refusing = None
        return results

    async def append_unique(self, events: Sequence[tuple[Event, str]]) -> list[Appended | None]:
        """Append each event only if no message on the stream matches its filter yet; all at once, in order.

        JetStream decides (expected last sequence 0 over the filter, nats-server 2.11 or later), so
        of two writers racing to be first under one filter exactly one wins, across processes.
        Returns each event's `Appended`, or None where the filter already matched (nothing
        appended; a repeat of an event already stored is one of these). Each is a request of its
        own, sent in order without waiting: nats-py's pipelined publish never completes a refused
        one (its reply handler raises the error instead of setting it on the future).
        """

        async def first(event: Event, over: str) -> Appended | None:
            data = self._checked(event.subject, encode(event))
            try:
                ack = await self.js.publish(
                    event.subject, data, headers=self._headers(event, 0, over), stream=self.stream
                )
            except nats.js.errors.APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    return None
                raise self._translate(exc, event.subject, 0) from None
            except nats.errors.OutboundBufferLimitError:
                raise self._not_sent(event.subject) from None
            except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError, nats.js.errors.NoStreamResponseError):
                raise EventStoreUnavailable(
                    f"JetStream did not acknowledge {event.subject}; retrying is safe"
                ) from None
            self.refusing = None
            return Appended(seq=ack.seq, duplicate=bool(ack.duplicate))

        return list(await asyncio.gather(*(first(event, over) for event, over in events)))

    @property
    def max_payload(self) -> int:
        """The largest message the server accepts (its `max_payload`; 1 MB when it says nothing)."""
        return int(self.nc.max_payload or 1 << 20)

    def _checked(self, subject: str, data: bytes) -> bytes:
        # headers (message id, expected sequence) count against max_payload too
        if len(data) + HEADER_ALLOWANCE > self.max_payload:
            raise EventTooLarge(subject, len(data), self.max_payload - HEADER_ALLOWANCE)
        return data

    def _translate(self, exc: nats.js.errors.APIError, subject: str, expected: int | None) -> EventStoreError:
        """The named error for JetStream's refusal; a refusal for lack of room also sets `refusing`."""
        code = exc.err_code or 0
        description = exc.description or "refused"
        if code == WRONG_LAST_SEQUENCE:
            return ConcurrencyConflict(subject, expected or 0, description)
        if code in STORE_FULL or "no space" in description.lower():
            full = StoreFull(subject, description, code)
            self.refusing = str(full)
            return full
        return EventStoreError(f"JetStream refused {subject}: {description} (code {code})")

    # ---- reading ---------------------------------------------------------------------------

    async def read(
        self,
        filter_subject: str | Sequence[str],
        *,
        after_seq: int = 0,
        last_per_subject: bool = False,
        unpack: bool = True,
    ) -> AsyncIterator[StoredEvent]:
        """Yield every stored event matching the filter(s), in stream order, then stop (see `read_raw`).

        `unpack=False` leaves calls' packed arrays as recorded (see `schemas.codec.decode`).
        """
        async for batch in self.read_raw(filter_subject, after_seq=after_seq, last_per_subject=last_per_subject):
            for msg in batch:
                yield to_stored(msg, unpack)

    def read_raw(
        self, filter_subject: str | Sequence[str], *, after_seq: int = 0, last_per_subject: bool = False
    ) -> AsyncIterator[list[Msg]]:
        """Yield batches of raw messages matching the filter(s) until none is pending.

        An ephemeral pull consumer with no acks, the next batch requested before this one is
        yielded (see `services.common.streamread`). `last_per_subject` reads only the newest
        message of each matching subject: the server finds those from its subject index, where a
        wildcard filter otherwise makes it test every message of the stream (a few small events of
        a large run then cost a scan of all of it).
        """
        return read_batches(
            self.nc, self.js, self.stream, filter_subject, after_seq=after_seq, last_per_subject=last_per_subject
        )

    async def read_rollout(self, run_id: str, rollout_id: str) -> list[StoredEvent]:
        """Every event of one rollout, in order, calls with their full prompts (ends when the stream is idle)."""
        subject = ROLLOUT_ALL.format(run=check_id("run_id", run_id), rollout=check_id("rollout_id", rollout_id))
        refs = Resolver()
        out = []
        async for stored in self.read(subject):
            event = stored.event
            if type(event) is ModelRequestRecorded and event.prompt_ref:
                stored = StoredEvent(seq=stored.seq, subject=stored.subject, event=await self._resolve(refs, event))
            elif type(event) is ModelRequestRecorded:
                refs.resolve(event)
            out.append(stored)
        return out

    async def resolved(self, event: ModelRequestRecorded, refs: Resolver | None = None) -> ModelRequestRecorded:
        """A call with its full prompt ids and request: what a monitor calls on a version-2 event.

        References are followed by direct gets of their stream sequences; pass one `Resolver` to
        many calls (in stream order) so each earlier call is read once.
        """
        return await self._resolve(refs or Resolver(), event)

    async def _resolve(self, refs: Resolver, event: ModelRequestRecorded) -> ModelRequestRecorded:
        try:
            return refs.resolve(event)
        except UnresolvedReference:
            pass
        missing: list[ModelRequestRecorded] = []
        ref = event.prompt_ref
        while ref and ref.event_id not in refs.seen:
            raw = await self.js.get_msg(self.stream, ref.seq)
            earlier = decode(raw.data or b"")
            if type(earlier) is not ModelRequestRecorded or earlier.event_id != ref.event_id:
                raise UnresolvedReference(f"stream sequence {ref.seq} is not the referenced call {ref.event_id}")
            missing.append(earlier)
            ref = earlier.prompt_ref
        for earlier in reversed(missing):
            refs.resolve(earlier)
        return refs.resolve(event)

    def read_run(self, run_id: str, *, after_seq: int = 0, unpack: bool = True) -> AsyncIterator[StoredEvent]:
        """Every event of one run, in order, as an async iterator (a run can be large).

        `unpack=False` leaves calls' packed arrays as recorded (see `schemas.codec.decode`).
        """
        return self.read(RUN_ALL.format(run=check_id("run_id", run_id)), after_seq=after_seq, unpack=unpack)

    async def last(self, subject: str) -> StoredEvent | None:
        """The last event on a subject (wildcards allowed: the last of all matching), or None."""
        try:
            raw = await self.js.get_last_msg(self.stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        return StoredEvent(seq=raw.seq or 0, subject=raw.subject or subject, event=decode(raw.data or b""))

    async def purge(self, subject: str) -> None:
        """Remove every event on the subject (wildcards allowed) from the stream, for good."""
        await self.js.purge_stream(self.stream, subject=subject)

    async def last_status(self, run_id: str, rollout_id: str) -> tuple[RolloutStatusChanged | None, int]:
        """The rollout's last status event and its stream sequence (None, 0 when it has none)."""
        subject = ROLLOUT_STATUS.format(run=check_id("run_id", run_id), rollout=check_id("rollout_id", rollout_id))
        try:
            raw = await self.js.get_last_msg(self.stream, subject)
        except nats.js.errors.NotFoundError:
            return None, 0
        event = decode(raw.data or b"")
        assert isinstance(event, RolloutStatusChanged)
        return event, raw.seq or 0

    async def last_sequence(self) -> int:
        """The stream's last sequence number (0 when empty)."""
        info = await self.js.stream_info(self.stream)
        return info.state.last_seq

    def subscribe(
        self,
        pattern: str | Sequence[str],
        *,
        start: StartFrom = "new",
        durable: str | None = None,
        since: float | None = None,
        after_seq: int | None = None,
        unpack: bool = True,
    ) -> AsyncGenerator[StoredEvent, None]:
        """Follow events matching `pattern` (or several patterns, in stream order) forever.

        Starts from the start, from now, from a time (`since`) or after a stream sequence
        (`after_seq`). With `durable`, the position is kept by the server: each event is
        acknowledged when the consumer asks for the next one, so a restarted monitor resumes
        after the last event it finished with. `unpack=False` leaves calls' packed arrays as
        recorded (see `schemas.codec.decode`).
        """
        return follow(
            self.js,
            self.stream,
            pattern,
            start=start,
            durable=durable,
            since=since,
            after_seq=after_seq,
            unpack=unpack,
        )
