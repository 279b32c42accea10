"""Calls visible from their start, and ended as `aborted` when the gateway serving them dies.

When a call has passed the phase gate and its request is written to the engine, the proxy puts a
light marker for it into the JetStream key-value bucket `rollwire_inflight` (key: `<gateway
instance id>.<call id>`; value: run, rollout, attempt, the gateway's instance id, mode and model)
without waiting for it: the marker costs the call no latency. When the call ends, recorded or not,
the proxy erases the marker: a key-value delete at the marker's revision whose delete marker
expires a second later (a per-message TTL), so the bucket holds the calls in flight (and, for a
second, the delete markers of those just ended): `nats kv ls rollwire_inflight` lists the calls.
A rollout's event history holds only what happened: the markers are transient state, not events
(entries also expire after `LOOKBACK_S`).

Every gateway heartbeats into the bucket `rollwire_gateways` (its instance id, entries expire after
three intervals). Once per interval it lists the bucket's keys (one `STREAM.INFO` with a subject
filter: the key names the gateway, so no marker is read) and, only for markers of gateways whose
heartbeat has expired and that it saw a whole interval ago, reads the marker (a delete marker,
listed in its one second, reads as no call) and records the call as `aborted` with the reason,
under the deterministic event id `<call_id>-reaped` (so several reapers append it once), then
erases the marker. A gateway therefore receives nothing per call of
another gateway (watching every marker cost each gateway two messages per call of the whole
cluster).

One terminal record per call, whatever the timing: the marker decides who records. Before its
record, the owner claims the marker by erasing it at the revision it wrote (`claim`: the erasure
fails when the marker changed since, so the claim is also the marker's removal, one write instead
of two); before its `aborted` record, a reaper claims it by a compare-and-set to `state: reaped`.
Exactly one of the two succeeds, and the loser appends nothing: a gateway paused past three
heartbeats (SIGSTOP, a long GC pause, a frozen VM) whose call was reaped meanwhile answers 503
instead of recording `ok` after the `aborted`. A marker a reaper claimed but whose `aborted` it did
not append (it died in between) is finished by any live gateway (same event id). A call its owner
claimed has no marker left: if the owner dies in the instant between its claim and its append, the
call stays unrecorded, as a call without a marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy, StreamConfig
from nats.js.kv import KeyValue

from schemas import ModelRequestRecorded
from services.common.eventstore import EventStore, EventStoreError, EventStoreUnavailable
from services.common.outage import Outage

BUCKET = "rollwire_gateways"
CALLS = "rollwire_inflight"
LOOKBACK_S = 3600.0
log = logging.getLogger("rollwire.gateway.reaper")


class CallMarker(msgspec.Struct, frozen=True, gc=False):
    """A call in flight, as kept in `rollwire_inflight`."""

    run_id: str
    rollout_id: str
    attempt_id: str | None
    gateway: str
    mode: str
    model: str
    state: str = "open"
    """`open`, or `reaped` (a reaper claimed it)."""
    by: str = ""
    """The gateway whose claim set `state` (the reaper's instance id for `reaped`)."""


class _InfoState(msgspec.Struct):
    subjects: dict[str, int] | None = None


class _Info(msgspec.Struct):
    state: _InfoState | None = None
    total: int = 0
    error: dict[str, Any] | None = None


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(CallMarker).decode
_decode_info = msgspec.json.Decoder(_Info).decode


class CallReaper:
    """This gateway's heartbeat, its `call_started` markers, and the reaping of dead gateways' calls."""

    def __init__(self, store: EventStore, *, interval_s: float = 5.0) -> None:
        self.store = store
        self.instance = secrets.token_hex(8)
        self.interval_s = interval_s
        self.open: dict[str, tuple[str, float]] = {}
        """Other gateways' calls in flight at the last listing: call id -> (gateway, when first listed)."""
        self.reaped = 0
        self.kv: KeyValue | None = None
        self.calls: KeyValue | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.mine: dict[str, tuple[str, asyncio.Future[int | None]]] = {}
        """This gateway's open calls: each one's marker key and the put that stores it (its revision, None if lost)."""
        self.lost = 0  # claims this gateway lost to a reaper (its call was recorded `aborted`)
        self.outage = Outage(log, "the call reaper's store")

    def started(self, run_id: str, rollout_id: str, attempt_id: str, call_id: str, mode: str, model: str) -> None:
        """Put the call's marker without waiting for JetStream (a lost marker only loses the reaping)."""
        marker = CallMarker(run_id, rollout_id, attempt_id, self.instance, mode, model)
        key, data = f"{self.instance}.{call_id}", _encode(marker)
        put = self.store.kv_put_nowait(CALLS, key, data)
        if put is None:
            put = asyncio.get_running_loop().create_task(self._put(key, data))
        self.mine[call_id] = key, put

    async def _put(self, key: str, data: bytes) -> int | None:
        try:
            return await self.store.kv_write(CALLS, key, data)
        except (nats.errors.Error, OSError):  # OSError: a TimeoutError too
            return None  # not stored: no reaper can see the call, so its owner records it unclaimed

    async def claim(self, call_id: str) -> bool:
        """Claim the call's marker before recording the call: False when a reaper claimed it first.

        The marker's erasure at the revision this gateway wrote: it fails only when the marker
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
        key, put = mine
        revision = await put
        if revision is None or self.calls is None:
            return _won()
        try:  # claimed by erasing it: a reaper's claim from the revision it read then fails
            pending = await self.store.kv_remove(CALLS, key, revision)
        except (nats.errors.Error, OSError):
            return _won()  # the store is unreachable: the record's own append fails and says so
        return self._verdict(call_id, pending)

    async def _verdict(self, call_id: str, pending: Awaitable[bool]) -> bool:
        try:
            erased = await pending
        except (nats.errors.Error, OSError):
            return True  # the store is unreachable: the record's own append fails and says so
        if not erased:
            self.lost += 1
            log.warning("call %s was recorded aborted by another gateway while this one was stalled", call_id)
            return False
        return True

    def ended(self, call_id: str) -> None:
        """Erase the call's marker (it was recorded, or its gateway is alive to answer for it)."""
        mine = self.mine.pop(call_id, None)
        if mine is not None:  # not claimed (nothing recorded): erase it once its put is done; a claim erased it
            key, put = mine
            put.add_done_callback(lambda done: self._erase(key, None if done.cancelled() else done.result()))

    def _erase(self, key: str, revision: int | None) -> None:
        """Erase a marker at `revision` without waiting (a marker left behind expires after `LOOKBACK_S`)."""
        if revision is None:
            return
        task = asyncio.get_running_loop().create_task(self._erase_now(key, revision))
        task.add_done_callback(_quiet)

    async def _erase_now(self, key: str, revision: int) -> None:
        await (await self.store.kv_remove(CALLS, key, revision))

    async def start(self) -> None:
        """Create the two buckets, then heartbeat and reap in the background."""
        self.kv = await self._bucket(BUCKET, 3 * self.interval_s)
        self.calls = await self._markers_bucket()
        await self.kv.put(self.instance, b"alive")
        self.tasks = [asyncio.get_running_loop().create_task(self._heartbeat())]

    async def _bucket(self, name: str, ttl: float) -> KeyValue:
        try:
            return await self.store.js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                await self.store.js.create_key_value(bucket=name, ttl=ttl, history=1)
            return await self.store.js.key_value(name)

    async def _markers_bucket(self) -> KeyValue:
        """The markers' bucket: a key-value bucket whose stream lets a message carry its own TTL
        (`allow_msg_ttl`, which nats-py's buckets lack), so that an erased marker's delete marker is gone
        a second later and the bucket holds only the calls in flight."""
        require_msg_ttl(self.store.nc)
        config = StreamConfig(
            name=f"KV_{CALLS}",
            subjects=[f"$KV.{CALLS}.>"],
            max_msgs_per_subject=1,
            max_age=LOOKBACK_S,
            allow_rollup_hdrs=True,
            # Older gateways erase markers by message delete: refused, a call they recorded would keep
            # its marker and be reaped as aborted too once they stop.
            deny_delete=False,
            discard=DiscardPolicy.NEW,
            allow_direct=True,
            allow_msg_ttl=True,
        )
        try:
            await self.store.js.add_stream(config)
        except nats.js.errors.BadRequestError:  # it exists, made by another gateway
            made = (await self.store.js.stream_info(f"KV_{CALLS}")).config
            if not made.allow_msg_ttl:  # by a gateway that erased markers by message delete
                await self.store.js.update_stream(dataclasses.replace(made, allow_msg_ttl=True))
        return await self.store.js.key_value(CALLS)

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

    async def listed(self) -> dict[str, str]:
        """The calls in flight on every gateway, from the bucket's subjects: call id -> gateway."""
        prefix = f"$KV.{CALLS}."
        calls: dict[str, str] = {}
        while True:  # the server answers at most 100,000 subjects at a time
            ask = {"subjects_filter": f"{prefix}>", "offset": len(calls)}
            reply = await self.store.nc.request(f"$JS.API.STREAM.INFO.KV_{CALLS}", _encode(ask), timeout=5)
            info = _decode_info(reply.data)
            if info.error is not None:
                raise EventStoreError(f"the call markers could not be listed: {info.error}")
            subjects = (info.state.subjects if info.state else None) or {}
            for subject in subjects:
                gateway, _, call_id = subject[len(prefix) :].partition(".")
                calls[call_id] = gateway
            if not subjects or len(calls) >= info.total:
                return calls

    async def reap(self) -> None:
        """Record as aborted every call in flight whose gateway stopped heartbeating, and erase its marker."""
        listed = await self.listed()  # before the heartbeats: a listed call's gateway was alive before it
        now = time.monotonic()
        self.open = {
            call_id: (gateway, self.open[call_id][1] if call_id in self.open else now)
            for call_id, gateway in listed.items()
            if gateway != self.instance
        }
        grace = now - self.interval_s  # only calls listed a whole interval ago
        candidates = [(call_id, gateway) for call_id, (gateway, seen) in self.open.items() if seen <= grace]
        if not candidates:
            return
        alive = await self.alive() | {self.instance}
        for call_id, gateway in candidates:
            if gateway not in alive and await self._reap_one(call_id, gateway, alive):
                self.open.pop(call_id, None)
                self.reaped += 1

    async def _reap_one(self, call_id: str, gateway: str, alive: set[str]) -> bool:
        """Claim a dead gateway's call and record it aborted; False when its owner (or a live reaper) has it."""
        assert self.calls is not None
        try:
            entry = await self.calls.get(f"{gateway}.{call_id}")
        except nats.js.errors.KeyNotFoundError:  # nats-py's `get` raises it for a delete marker too
            return False  # its owner claimed it since the listing (its delete marker lives a second)
        try:
            call = _decode(entry.value or b"")
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        revision = entry.revision or 0
        if call.state == "reaped" and call.by in alive:
            return False  # a live reaper is recording it
        if call.state == "open":
            claimed = msgspec.structs.replace(call, state="reaped", by=self.instance)
            try:
                revision = await self.calls.update(f"{gateway}.{call_id}", _encode(claimed), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return False  # its owner claimed it (or another reaper did)
        await self.store.append(_aborted(call_id, call, self.interval_s))
        self._erase(f"{gateway}.{call_id}", revision)
        return True


def require_msg_ttl(nc: NATS) -> None:
    """Refuse a nats-server without per-message TTLs (before 2.11), whose delete markers would stay in
    the markers' bucket for an hour: `EventStoreError` with what to upgrade."""
    version = nc.connected_server_version
    if (version.major, version.minor) < (2, 11):
        raise EventStoreError(
            f"nats-server {version.major}.{version.minor} is too old: the gateway needs 2.11 or newer "
            "(its call markers' delete markers expire by per-message TTL)"
        )


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
