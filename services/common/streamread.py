"""Reading the Rollwire stream: one-shot reads that end when nothing is pending, and follows that
never end. `EventStore.read_raw`, `read` and `subscribe` are these; use them through the store.

- A one-shot read (`read_batches`) is an ephemeral pull consumer with no acks; batches are
  requested with `no_wait` and delivered to one callback subscription, which avoids a task per
  message in the client. The next batch is requested before this one is yielded, so the server
  reads and sends it while the caller works (one request in flight).
- A follow (`follow`) is a pull subscription fetching forever; with a durable name the server
  keeps its position, each event acknowledged when the caller asks for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Literal

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import AnyEvent, decode
from services.common.storeerrors import EventStoreUnavailable

FETCH_BATCH = 2048

StartFrom = Literal["start", "new"]


class StoredEvent(msgspec.Struct, frozen=True, gc=False):
    """An event as read back from the stream, with its stream sequence and subject."""

    seq: int
    subject: str
    event: AnyEvent


class _Batch:
    """Collects the messages answering one pull request; `done` is set when it is complete."""

    def __init__(self) -> None:
        self.messages: list[Msg] = []
        self.wanted = 0
        self.done = asyncio.Event()

    def expect(self, wanted: int) -> None:
        self.messages = []
        self.wanted = wanted
        self.done.clear()

    async def on_message(self, msg: Msg) -> None:
        if msg.headers and "Status" in msg.headers:  # 404 no messages / 408 timeout: the batch ended early
            self.done.set()
            return
        self.messages.append(msg)
        if len(self.messages) >= self.wanted:
            self.done.set()


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that a timeout inside nats-py swallowed.

    On Python 3.11, `asyncio.wait_for` (which nats-py's fetch uses) can turn a cancellation that
    races with its timeout into a TimeoutError; a loop that retries on timeouts would then never
    stop. The task still counts the request (`cancelling()`), so it is raised again here. Our own
    waits use `asyncio.timeout`, which keeps the cancellation; this is for third-party ones.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def stream_sequence(reply: str) -> int:
    """The stream sequence from a JetStream ack subject, without building nats-py's metadata object.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>`; the newer
    form adds `<domain>.<account hash>` after `$JS.ACK` (and a random token at the end).
    """
    tokens = reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])


def to_stored(msg: Msg, unpack: bool = True) -> StoredEvent:
    """A delivered message as a `StoredEvent` (`unpack=False`: see `schemas.codec.decode`)."""
    return StoredEvent(stream_sequence(msg.reply), msg.subject, decode(msg.data, unpack=unpack))


def _filtered(config: ConsumerConfig, filters: Sequence[str]) -> ConsumerConfig:
    """The config with its filter: one subject, or several (nats-server 2.10 or later)."""
    if len(filters) == 1:
        config.filter_subject = filters[0]
    else:
        config.filter_subjects = list(filters)
    return config


def _read_config(name: str, filters: Sequence[str], after_seq: int, last_per_subject: bool) -> ConsumerConfig:
    """The ephemeral, unacknowledged consumer of a one-shot read."""
    policy = DeliverPolicy.BY_START_SEQUENCE if after_seq else DeliverPolicy.ALL
    if last_per_subject:
        if after_seq:
            raise ValueError("a read of the last message per subject starts at the stream's start")
        policy = DeliverPolicy.LAST_PER_SUBJECT
    config = ConsumerConfig(
        name=name,
        ack_policy=AckPolicy.NONE,
        deliver_policy=policy,
        opt_start_seq=after_seq + 1 if after_seq else None,
        inactive_threshold=30.0,
        mem_storage=True,
        max_ack_pending=-1,
    )
    return _filtered(config, filters)


async def read_batches(
    nc: NATS,
    js: JetStreamContext,
    stream: str,
    filter_subject: str | Sequence[str],
    *,
    after_seq: int = 0,
    last_per_subject: bool = False,
) -> AsyncIterator[list[Msg]]:
    """Yield batches of raw messages matching the filter(s) until none is pending (see the module docstring)."""
    filters = [filter_subject] if isinstance(filter_subject, str) else list(filter_subject)
    name = secrets.token_hex(8)
    info = await js.add_consumer(stream, _read_config(name, filters, after_seq, last_per_subject))
    remaining = info.num_pending or 0
    batch = _Batch()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=batch.on_message, pending_bytes_limit=1 << 30)
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}"

    async def request() -> None:
        batch.expect(min(FETCH_BATCH, remaining))
        await nc.publish(next_subject, b'{"batch":%d,"no_wait":true}' % batch.wanted, reply=inbox)

    try:
        if remaining > 0:
            await request()
        while remaining > 0:
            try:
                await asyncio.wait_for(batch.done.wait(), 10.0)
            except TimeoutError:
                raise EventStoreUnavailable("JetStream stopped delivering during a read") from None
            msgs = batch.messages
            if not msgs:
                break
            remaining -= len(msgs)
            if remaining > 0:  # the next batch is on its way while the caller works on this one
                await request()
            yield msgs
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, name)


def _follow_config(
    patterns: Sequence[str], start: StartFrom, durable: str | None, since: float | None, after_seq: int | None
) -> ConsumerConfig:
    """The consumer of a follow: where it starts, and whether the server keeps its position."""
    if after_seq is not None:
        deliver = DeliverPolicy.BY_START_SEQUENCE
    elif since is not None:
        deliver = DeliverPolicy.BY_START_TIME
    else:
        deliver = DeliverPolicy.ALL if start == "start" else DeliverPolicy.NEW
    config = ConsumerConfig(
        ack_policy=AckPolicy.EXPLICIT if durable else AckPolicy.NONE,
        deliver_policy=deliver,
        opt_start_time=datetime.fromtimestamp(since, tz=UTC) if since is not None and after_seq is None else None,
        opt_start_seq=after_seq + 1 if after_seq is not None else None,
        inactive_threshold=None if durable else 60.0,
        max_ack_pending=-1 if not durable else 10_000,
    )
    return _filtered(config, patterns)


async def follow(
    js: JetStreamContext,
    stream: str,
    pattern: str | Sequence[str],
    *,
    start: StartFrom = "new",
    durable: str | None = None,
    since: float | None = None,
    after_seq: int | None = None,
    unpack: bool = True,
) -> AsyncGenerator[StoredEvent, None]:
    """Follow events matching `pattern` forever (the store's `subscribe` says how it starts)."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    config = _follow_config(patterns, start, durable, since, after_seq)
    psub = await js.pull_subscribe(patterns[0], durable=durable, stream=stream, config=config)
    unfinished: list[Msg] = []
    try:
        while True:
            try:
                unfinished = await psub.fetch(256, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises both on an idle fetch
                raise_if_cancelling()
                continue
            while unfinished:
                yield to_stored(unfinished[0], unpack)
                if durable:
                    await unfinished[0].ack()
                unfinished.pop(0)
    finally:
        if durable:
            # Hand back what was fetched but not finished, so a restart resumes right there.
            for msg in unfinished:
                with contextlib.suppress(Exception):
                    await msg.nak()
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
