"""Calls visible from their start, and ended as `aborted` when the gateway serving them dies.

When a call passes the phase gate, the proxy puts a light marker for it into the JetStream
key-value bucket `rollwire_calls` (key: the call id; value: run, rollout, attempt, the gateway's
instance id, mode and model) with a plain NATS publish: JetStream stores it, nothing waits for its
ack, so the marker costs the call no latency. When the call ends, recorded or not, the proxy
deletes the key the same way. In-flight calls are therefore visible to anyone
(`nats kv watch rollwire_calls`), and a rollout's event history holds only what happened: the
markers are transient state, not events (entries also expire after `LOOKBACK_S`).

Every gateway heartbeats into the bucket `rollwire_gateways` (its instance id, entries expire after
three intervals) and watches `rollwire_calls`. A call whose gateway's heartbeat has expired is
recorded by any live gateway as `aborted` with the reason, under the deterministic event id
`<call_id>-reaped` (so several reapers append it once), and its marker is deleted. The engine's
tokens for such a call are lost (the gateway held them), but the call, its rollout attempt and why
it ended are on the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from schemas import ModelRequestRecorded
from services.common.eventstore import EventStore, EventStoreError

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

    def started(self, run_id: str, rollout_id: str, attempt_id: str, call_id: str, mode: str, model: str) -> None:
        """Put the call's marker without waiting for JetStream (a lost marker only loses the reaping)."""
        marker = CallMarker(run_id, rollout_id, attempt_id, self.instance, mode, model)
        self._publish(call_id, _encode(marker), None)

    def ended(self, call_id: str) -> None:
        """Delete the call's marker (it was recorded, or its gateway is alive to answer for it)."""
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
                log.warning("reaper: %s", exc)

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
            if call.gateway in alive or call.seen > grace:
                continue
            event = ModelRequestRecorded(
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
                    f"no heartbeat for {3 * self.interval_s:g}s"
                ),
            )
            await self.store.append(event)
            self.open.pop(call_id, None)
            self.ended(call_id)
            self.reaped += 1

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
                self.open.setdefault(entry.key, msgspec.structs.replace(marker, seen=time.monotonic()))
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


def _quiet(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
