"""Calls visible from their start, and ended as `aborted` when the gateway serving them dies.

When a call passes the phase gate, the proxy publishes a light `call_started` marker (a custom
event on `rl.<run>.rollout.<rollout>.event.call_started`: call id, the gateway's instance id, the
API and the model) with a plain NATS publish: JetStream stores it, nothing waits for its ack, so
the marker costs the call no latency. The call's `model_request` follows when it ends.

Every gateway heartbeats into the JetStream key-value bucket `rollwire_gateways` (its instance id,
entries expire after three intervals) and follows the markers and the calls of the last hour. A
started call with no `model_request` whose gateway's heartbeat has expired is recorded by any
live gateway as `aborted` with the reason, under the deterministic event id `<call_id>-reaped`,
so several reapers append it once. The engine's tokens for such a call are lost (the gateway held
them), but the call, its rollout attempt and why it ended are on the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue

from schemas import CustomEvent, MalformedEvent, ModelRequestRecorded, decode, encode
from services.common.eventstore import EventStore, EventStoreError, raise_if_cancelling

CALL_STARTED = "call_started"
BUCKET = "rollwire_gateways"
LOOKBACK_S = 3600.0
ENDED_KEPT = 100_000
_CALL_ID = re.compile(rb'"call_id":"([^"]+)"')
log = logging.getLogger("rollwire.gateway.reaper")


class _Open:
    __slots__ = ("attempt_id", "gateway", "mode", "model", "rollout_id", "run_id", "seen")

    def __init__(self, event: CustomEvent) -> None:
        self.run_id, self.rollout_id, self.attempt_id = event.run_id, event.rollout_id, event.attempt_id
        self.gateway = str(event.payload.get("gateway", ""))
        self.mode = "val" if event.payload.get("mode") == "val" else "train"
        self.model = str(event.payload.get("model", ""))
        self.seen = time.monotonic()


class CallReaper:
    """This gateway's heartbeat, its `call_started` markers, and the reaping of dead gateways' calls."""

    def __init__(self, store: EventStore, *, interval_s: float = 5.0) -> None:
        self.store = store
        self.instance = secrets.token_hex(8)
        self.interval_s = interval_s
        self.open: dict[str, _Open] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.reaped = 0
        self.kv: KeyValue | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def started(self, run_id: str, rollout_id: str, attempt_id: str, call_id: str, mode: str, model: str) -> None:
        """Publish the call's marker without waiting for JetStream (a lost marker only loses the reaping)."""
        event = CustomEvent(
            run_id=run_id,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            event_id=f"{call_id}-started",
            name=CALL_STARTED,
            payload={"call_id": call_id, "gateway": self.instance, "mode": mode, "model": model},
        )
        task = asyncio.get_running_loop().create_task(
            self.store.nc.publish(event.subject, encode(event), headers={"Nats-Msg-Id": event.event_id})
        )
        task.add_done_callback(_quiet)

    async def start(self) -> None:
        """Create the heartbeat bucket, then heartbeat, follow and reap in the background."""
        ttl = 3 * self.interval_s
        try:
            self.kv = await self.store.js.key_value(BUCKET)
        except nats.js.errors.BucketNotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                await self.store.js.create_key_value(bucket=BUCKET, ttl=ttl, history=1)
            self.kv = await self.store.js.key_value(BUCKET)
        await self.kv.put(self.instance, b"alive")
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._heartbeat()), loop.create_task(self._follow())]

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
        """Record as aborted every open call whose gateway stopped heartbeating."""
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
                mode=call.mode,  # type: ignore[arg-type]
                status="aborted",
                model=call.model,
                error=(
                    f"the gateway serving this call ({call.gateway}) stopped before recording it: "
                    f"no heartbeat for {3 * self.interval_s:g}s"
                ),
            )
            await self.store.append(event)
            self.open.pop(call_id, None)
            self.reaped += 1

    async def _follow(self) -> None:
        """Track started calls and the calls that ended, from the last hour on."""
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.fromtimestamp(time.time() - LOOKBACK_S, tz=UTC),
            filter_subjects=[f"rl.*.rollout.*.event.{CALL_STARTED}", "rl.*.rollout.*.model_request"],
            inactive_threshold=60.0,
            max_ack_pending=-1,
        )
        psub = await self.store.js.pull_subscribe(
            f"rl.*.rollout.*.event.{CALL_STARTED}", stream=self.store.stream, config=config
        )
        try:
            while True:
                try:
                    msgs = await psub.fetch(512, timeout=1.0)
                except (TimeoutError, nats.errors.TimeoutError):
                    raise_if_cancelling()
                    continue
                for msg in msgs:
                    self._see(msg.subject, msg.data)
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    def _see(self, subject: str, data: bytes) -> None:
        if subject.endswith(".model_request"):
            match = _CALL_ID.search(data, 0, 2048)
            if match:
                call_id = match.group(1).decode()
                self.open.pop(call_id, None)
                self.ended[call_id] = None  # a marker that arrives after its call must not open it
                if len(self.ended) > ENDED_KEPT:
                    self.ended.popitem(last=False)
            return
        try:
            event = decode(data)
        except MalformedEvent:
            return
        call_id = event.payload.get("call_id") if isinstance(event, CustomEvent) else None
        if isinstance(event, CustomEvent) and isinstance(call_id, str) and call_id not in self.ended:
            self.open.setdefault(call_id, _Open(event))


def _quiet(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
