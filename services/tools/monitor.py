"""Custom monitors: typed events for subject patterns, and custom events published back.

    async with await Monitor.connect("nats://127.0.0.1:14222", name="my-monitor") as monitor:
        async for event in monitor.events("rl.*.rollout.*.model_request", durable="my-monitor"):
            if looks_wrong(event):
                await monitor.flag(event, rule="looks-wrong", severity="warning", detail="...")

`events` follows the stream through the event store's own subscription (`EventStore.subscribe`):
from now (default), from the start, or from a time. With a `durable` name the server keeps the
position: an event counts as done when the monitor asks for the next one, so a monitor that is
stopped and started again resumes right after the last event it finished (the one it was working
on comes again). A monitor's reaction should therefore be idempotent, and `flag` makes it so: the
flag's event id is derived from the monitor, the event it is about and the rule, so flagging the
same thing twice is acknowledged by JetStream as a duplicate (within the stream's duplicate window)
instead of being stored twice.

A flag is a `CustomEvent` named `flag` on the rollout's subject (`rl.<run>.rollout.<id>.event.flag`)
with payload `{monitor, rule, severity, detail, call_id}`; the trajectory viewer shows it with the
rollout's other custom events.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal, cast

import msgspec
import nats.js.errors

from schemas import AnyEvent, CustomEvent, Event, ModelRequestRecorded, check_id
from schemas.events import FLAG_EVENT
from services.common.eventstore import Appended, EventStore, EventStoreError, StartFrom, StoredEvent
from services.devstack.credentials import local_credentials

Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")


class Flag(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a monitor's `flag` event."""

    monitor: str
    rule: str
    severity: Severity = "warning"
    detail: str = ""
    call_id: str | None = None


def flag_event_id(monitor: str, about: str, rule: str) -> str:
    """The deterministic event id of a flag, so that flagging the same thing again is a duplicate."""
    return hashlib.sha256(f"{monitor}\x00{about}\x00{rule}".encode()).hexdigest()[:40]


class Monitor:
    """A monitor's connection: follow events by pattern, look back in a rollout, publish flags."""

    def __init__(self, store: EventStore, name: str, *, owns_store: bool = False) -> None:
        self.store = store
        self.name = check_id("monitor name", name)
        self._owns_store = owns_store
        self.options: argparse.Namespace = argparse.Namespace()
        """The script's parsed options when run by `monitor_main`."""

    @classmethod
    async def connect(cls, url: str, *, name: str) -> Monitor:
        """Connect to the event store at `url` as the monitor `name` (the stream must exist)."""
        store = await EventStore.connect(url, ensure=False, name=f"monitor-{name}")
        try:
            await store.js.stream_info(store.stream)
        except nats.js.errors.NotFoundError:
            await store.close()
            raise EventStoreError(
                f"the stream {store.stream} does not exist at {url} yet; start the stack (`rollwire up`) first"
            ) from None
        return cls(store, name, owns_store=True)

    async def close(self) -> None:
        """Close the connection if the monitor opened it."""
        if self._owns_store:
            await self.store.close()

    async def __aenter__(self) -> Monitor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stored(
        self,
        pattern: str | Sequence[str],
        *,
        start: StartFrom = "new",
        since: float | None = None,
        durable: str | None = None,
        after_seq: int | None = None,
    ) -> AsyncGenerator[StoredEvent, None]:
        """Events matching the pattern(s) with their stream sequence and subject, forever.

        An async generator: close it (`contextlib.aclosing`) to hand back what it fetched at once.
        The subscription starts at the first iteration; `after_seq` pins "from now" to a sequence.
        """
        stream = self.store.subscribe(pattern, start=start, since=since, durable=durable, after_seq=after_seq)
        return cast(AsyncGenerator[StoredEvent, None], stream)

    async def events(
        self,
        pattern: str | Sequence[str],
        *,
        start: StartFrom = "new",
        since: float | None = None,
        durable: str | None = None,
        types: tuple[type[Event], ...] = (),
    ) -> AsyncIterator[AnyEvent]:
        """Typed events matching the pattern(s), in stream order, forever (only `types` when given).

        `start="start"` replays the stream's history first; `since` (Unix seconds) starts at a
        time; `durable` resumes where a monitor of that name stopped (see the module docstring).
        """
        # aclosing: when the caller stops, the subscription hands back what it fetched right away.
        async with contextlib.aclosing(self.stored(pattern, start=start, since=since, durable=durable)) as stream:
            async for stored in stream:
                if not types or isinstance(stored.event, types):
                    yield stored.event

    async def earlier(self, subject: str, before_seq: int) -> list[StoredEvent]:
        """The events on `subject` stored before `before_seq`: what happened before the monitor came.

        A monitor that starts late, or resumes after a restart, rebuilds its state for a rollout
        from this the first time it sees the rollout. Costs one request when there is none.
        """
        try:
            first = await self.store.js.get_msg(self.store.stream, seq=1, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return []
        if not first.seq or first.seq >= before_seq:
            return []
        found = []
        async for stored in self.store.read(subject):
            if stored.seq >= before_seq:
                break
            found.append(stored)
        return found

    async def publish(self, event: CustomEvent) -> Appended:
        """Publish a custom event of the monitor's own (a duplicate event id is a no-op)."""
        return await self.store.append(event)

    async def flag(
        self,
        about: Event,
        *,
        rule: str,
        severity: Severity = "warning",
        detail: str = "",
        key: str | None = None,
    ) -> Appended:
        """Flag the rollout of `about` (a call, or any event of a rollout) for `rule`.

        `key` says what one flag is about (default: the event's id, so one flag per event and
        rule); the runaway monitor passes the rollout id to flag a rollout once per rule.
        """
        if about.rollout_id is None:
            raise ValueError(f"{type(about).__name__} has no rollout to flag")
        if severity not in SEVERITIES:
            raise ValueError(f"severity {severity!r} is not one of {', '.join(SEVERITIES)}")
        payload = Flag(
            monitor=self.name,
            rule=rule,
            severity=severity,
            detail=detail,
            call_id=about.call_id if isinstance(about, ModelRequestRecorded) else None,
        )
        event = CustomEvent(
            run_id=about.run_id,
            rollout_id=about.rollout_id,
            attempt_id=about.attempt_id,
            event_id=flag_event_id(self.name, key or about.event_id, rule),
            name=FLAG_EVENT,
            payload=msgspec.to_builtins(payload),
        )
        return await self.publish(event)


def flags_of(events: Sequence[AnyEvent]) -> list[tuple[str | None, dict[str, Any]]]:
    """(rollout id, payload) of every flag among `events` (for tests and reports)."""
    return [
        (e.rollout_id, e.payload) for e in events if isinstance(e, CustomEvent) and e.name == FLAG_EVENT and e.trusted
    ]


Handler = Callable[[Monitor, StoredEvent], Awaitable[None]]


def monitor_main(
    name: str,
    handle: Handler,
    *,
    pattern: str | Sequence[str],
    doc: str = "",
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Run a monitor script: parse the common options, follow the pattern, call `handle` per event.

    Options: `--nats-url` (default $NATS_URL or the embedded stack's), `--pattern` (repeatable),
    `--durable NAME` (resume where a monitor of that name stopped; default: the monitor's name),
    `--from-start`, `--no-durable`. `extra` adds the script's own options; the parsed options are
    set on `monitor.options` before the first event. SIGINT and SIGTERM stop it cleanly.
    """
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0] if doc else name)
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:14222"))
    parser.add_argument("--pattern", action="append", help=f"subject pattern (repeatable; default {pattern})")
    parser.add_argument("--durable", default=name, help="consumer name to resume from (default: %(default)s)")
    parser.add_argument("--no-durable", action="store_true", help="do not keep a position on the server")
    parser.add_argument("--from-start", action="store_true", help="begin with the oldest stored event")
    if extra is not None:
        extra(parser)
    options = parser.parse_args(argv)

    async def run() -> None:
        monitor = await Monitor.connect(local_credentials(options.nats_url), name=name)
        monitor.options = options
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, lambda: task.cancel() if task else None)
        durable = None if options.no_durable else options.durable
        start: StartFrom = "start" if options.from_start else "new"
        # "From now" is the stream's last sequence at this moment, not whenever the consumer is made.
        after_seq = None if options.from_start else await monitor.store.last_sequence()
        patterns = options.pattern or ([pattern] if isinstance(pattern, str) else list(pattern))
        print(f"{name}: following {', '.join(patterns)}", flush=True)
        try:
            stream = monitor.stored(patterns, start=start, durable=durable, after_seq=after_seq)
            async with contextlib.aclosing(stream):
                async for stored in stream:
                    await handle(monitor, stored)
        except asyncio.CancelledError:
            pass
        finally:
            await monitor.close()

    asyncio.run(run())
    return options
