"""Calls visible from their start, and ended as `aborted` when the gateway serving them dies.

When a call passes the phase gate, the proxy puts a light marker for it into the JetStream
key-value bucket `rollwire_calls` (key: the call id; value: run, rollout, attempt, the gateway's
instance id, mode and model) without waiting for it: the marker costs the call no latency. When
the call ends, recorded or not, the proxy deletes the key the same way. In-flight calls are
therefore visible to anyone (`nats kv watch rollwire_calls`), and a rollout's event history holds
only what happened: the markers are transient state, not events (entries also expire after
`LOOKBACK_S`).

Every gateway heartbeats into the bucket `rollwire_gateways` (its instance id, entries expire after
three intervals) and watches `rollwire_calls`. A call whose gateway's heartbeat has expired is
recorded by any live gateway as `aborted` with the reason, under the deterministic event id
`<call_id>-reaped` (so several reapers append it once), and its marker is deleted. The engine's
tokens for such a call are lost (the gateway held them), but the call, its rollout attempt and why
it ended are on the stream.

One terminal record per call, whatever the timing: the marker decides who records. Before its
record, the owner claims the marker (`claim`: a compare-and-set delete from the revision it wrote,
so the claim is also the marker's delete, one write instead of two); before its `aborted` record, a
reaper claims it by a compare-and-set to `state: reaped`. Exactly one of the two compare-and-sets
succeeds, and the loser appends nothing: a gateway paused past
three heartbeats (SIGSTOP, a long GC pause, a frozen VM) whose call was reaped meanwhile answers
503 instead of recording `ok` after the `aborted` (two terminal records before). A marker a reaper
claimed but whose `aborted` it did not append (it died in between) is finished by any live
gateway (same event id). A call its owner claimed has no marker left: if the owner dies in the
instant between its claim and its append, the call stays unrecorded, as a call without a marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from schemas import ModelRequestRecorded
from services.common.eventstore import EventStore, EventStoreError, EventStoreUnavailable
from services.common.outage import Outage

BUCKET = "rollwire_gateways"
CALLS = "rollwire_calls"
LOOKBACK_S = 3600.0
log = logging.getLogger("rollwire.gateway.reaper")


class CallMarker(msgspec.Struct, frozen=True, gc=False):
    """A call in flight, as kept in `rollwire_calls`."""

    run_id: str
    rollout_id: str
    attempt_id: str | None
    gateway: str
    mode: str
    model: str
    seen: float = 0.0  # when this gateway first saw it (monotonic; not stored)
    state: str = "open"
    """`open`, `reaped` (a reaper claimed it) or `ending` (its owner claimed it, as gateways did before an
    owner's claim deleted the marker; still honoured while such gateways run beside this one)."""
    by: str = ""
    """The gateway whose claim set `state` (the reaper's instance id for `reaped`)."""
    revision: int = 0  # the marker's revision in the bucket (not stored)


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(CallMarker).decode


class CallReaper:
    """This gateway's heartbeat, its `call_started` markers, and the reaping of dead gateways' calls."""

    def __init__(self, store: EventStore, *, interval_s: float = 5.0) -> None:
        self.store = store
        self.instance = secrets.token_hex(8)
        self.interval_s = interval_s
        self.open: dict[str, CallMarker] = {}
        self.reaped = 0
        self.kv: KeyValue | None = None
        self.calls: KeyValue | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.mine: dict[str, tuple[CallMarker, asyncio.Task[int | None]]] = {}
        """This gateway's open calls: each marker and the put that stores it (its revision, None if lost)."""
        self.lost = 0  # claims this gateway lost to a reaper (its call was recorded `aborted`)
        self.claimed: set[str] = set()
        """Calls whose claim deleted their marker (until they end)."""
        self.outage = Outage(log, "the call reaper's store")

    def started(self, run_id: str, rollout_id: str, attempt_id: str, call_id: str, mode: str, model: str) -> None:
        """Put the call's marker without waiting for JetStream (a lost marker only loses the reaping)."""
        marker = CallMarker(run_id, rollout_id, attempt_id, self.instance, mode, model)
        task = asyncio.get_running_loop().create_task(self._put(call_id, marker))
        self.mine[call_id] = (marker, task)

    async def _put(self, call_id: str, marker: CallMarker) -> int | None:
        try:
            return await self.store.kv_write(CALLS, call_id, _encode(marker))
        except (nats.errors.Error, OSError):  # OSError: a TimeoutError too
            return None  # not stored: no reaper can see the call, so its owner records it unclaimed

    async def claim(self, call_id: str) -> bool:
        """Claim the call's marker before recording the call: False when a reaper claimed it first.

        A compare-and-set delete from the revision this gateway wrote: it fails only when the marker
        changed since, which only a reaper does (then its `aborted` is the call's record, and the
        caller appends nothing). A marker that was never stored cannot be reaped: True.
        """
        return await (await self.send_claim(call_id))

    async def send_claim(self, call_id: str) -> Awaitable[bool]:
        """`claim` in two steps: send the claim now and return what awaits its verdict (await it always),
        so that the call's record is built while the claim travels."""
        mine = self.mine.pop(call_id, None)
        if mine is None:
            return _won()
        revision = await mine[1]
        if revision is None or self.calls is None:
            return _won()
        try:  # claimed by deleting it: a reaper's claim from the revision it read then fails
            pending = await self.store.kv_send(CALLS, call_id, b"", last=revision, delete=True)
        except (nats.errors.Error, OSError):
            return _won()  # the store is unreachable: the record's own append fails and says so
        return self._verdict(call_id, pending)

    async def _verdict(self, call_id: str, pending: Awaitable[int]) -> bool:
        try:
            await pending
        except nats.js.errors.KeyWrongLastSequenceError:
            self.lost += 1
            log.warning("call %s was recorded aborted by another gateway while this one was stalled", call_id)
            return False
        except (nats.errors.Error, OSError):
            return True  # the store is unreachable: the record's own append fails and says so
        self.claimed.add(call_id)
        return True

    def ended(self, call_id: str) -> None:
        """Delete the call's marker (it was recorded, or its gateway is alive to answer for it)."""
        mine = self.mine.pop(call_id, None)
        if mine is not None:  # not claimed (nothing recorded): delete it once its put is done
            mine[1].add_done_callback(lambda _: self._publish(call_id, b"", {"KV-Operation": "DEL"}))
            return
        if call_id in self.claimed:  # its claim deleted it
            self.claimed.discard(call_id)
            return
        self._publish(call_id, b"", {"KV-Operation": "DEL"})

    def _publish(self, call_id: str, data: bytes, headers: dict[str, str] | None) -> None:
        task = asyncio.get_running_loop().create_task(
            self.store.nc.publish(f"$KV.{CALLS}.{call_id}", data, headers=headers)
        )
        task.add_done_callback(_quiet)

    async def start(self) -> None:
        """Create the two buckets, then heartbeat, watch the calls and reap in the background."""
        self.kv = await self._bucket(BUCKET, 3 * self.interval_s)
        self.calls = await self._bucket(CALLS, LOOKBACK_S)
        await self.kv.put(self.instance, b"alive")
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._heartbeat()), loop.create_task(self._follow())]

    async def _bucket(self, name: str, ttl: float) -> KeyValue:
        try:
            return await self.store.js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                await self.store.js.create_key_value(bucket=name, ttl=ttl, history=1)
            return await self.store.js.key_value(name)

    async def stop(self) -> None:
        """Stop the background work and withdraw this gateway's heartbeat (its calls were drained)."""
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.kv is not None:
            with contextlib.suppress(Exception):
                await self.kv.delete(self.instance)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                assert self.kv is not None
                await self.kv.put(self.instance, b"alive")
                await self.reap()
            except (nats.errors.Error, EventStoreError, OSError) as exc:
                if self.store.nc.is_connected:  # a lost connection is logged once, by the event store
                    self.outage.failed(exc, "heartbeat and reaping")
            else:
                self.outage.ok()

    async def alive(self) -> set[str]:
        """Instance ids of the gateways whose heartbeat has not expired."""
        assert self.kv is not None
        try:
            return set(await self.kv.keys())
        except nats.js.errors.NoKeysError:
            return set()

    async def reap(self) -> None:
        """Record as aborted every open call whose gateway stopped heartbeating, and delete its marker."""
        if not self.open:
            return
        alive = await self.alive() | {self.instance}
        grace = time.monotonic() - self.interval_s
        for call_id, call in list(self.open.items()):
            if call.seen > grace or call.state == "ending":
                continue  # new to this gateway, or its owner is recording it
            if call.state == "reaped" and call.by in alive:
                continue  # a live reaper is recording it
            if call.state == "open" and call.gateway in alive:
                continue
            if call.state == "open" and not await self._claim_dead(call_id, call):
                continue
            await self.store.append(_aborted(call_id, call, self.interval_s))
            self.open.pop(call_id, None)
            self._publish(call_id, b"", {"KV-Operation": "DEL"})
            self.reaped += 1

    async def _claim_dead(self, call_id: str, call: CallMarker) -> bool:
        """Claim a dead gateway's call for its `aborted` record; False when its owner (or another reaper) won."""
        assert self.calls is not None
        claimed = msgspec.structs.replace(call, state="reaped", by=self.instance)
        try:
            await self.calls.update(call_id, _encode(claimed), last=call.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False  # the marker changed: the watcher brings its new state
        return True

    async def _follow(self) -> None:
        """Keep `open` equal to the markers in `rollwire_calls` (a put opens a call, a delete ends it)."""
        assert self.calls is not None
        watcher = await self.calls.watchall()
        try:
            async for entry in watcher:
                if entry is None:  # the bucket's current markers have all arrived
                    continue
                if entry.operation is not None:
                    self.open.pop(entry.key, None)
                    continue
                try:
                    marker = _decode(entry.value or b"")
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                known = self.open.get(entry.key)
                seen = known.seen if known is not None else time.monotonic()
                self.open[entry.key] = msgspec.structs.replace(marker, seen=seen, revision=entry.revision or 0)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


def _aborted(call_id: str, call: CallMarker, interval_s: float) -> ModelRequestRecorded:
    """The `aborted` record of a call whose gateway died (one id for it, whoever reaps it)."""
    return ModelRequestRecorded(
        run_id=call.run_id,
        rollout_id=call.rollout_id,
        attempt_id=call.attempt_id,
        event_id=f"{call_id}-reaped",
        call_id=call_id,
        mode="val" if call.mode == "val" else "train",
        status="aborted",
        model=call.model,
        error=(
            f"the gateway serving this call ({call.gateway}) stopped before recording it: "
            f"no heartbeat for {3 * interval_s:g}s"
        ),
    )


async def _won() -> bool:
    return True


def _quiet(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class CallReaped(EventStoreUnavailable):
    """A reaper recorded this call `aborted` while its gateway was stalled: its answer is not recorded."""

    def __init__(self, call_id: str) -> None:
        super().__init__(
            f"call {call_id} was recorded as aborted by another gateway while this one was stalled past "
            "three heartbeats; its answer is not recorded"
        )
