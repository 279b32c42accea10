"""The phase gate across gateway replicas: an update holds and drains calls on every gateway.

`POST /api/phase {"phase": "update"}` reaches one gateway. It writes a close request for the run
into the JetStream key-value bucket `rollwire_phase` (`close.<run hash>`: run id and a fresh
token). Every gateway watches the bucket: on a close request it closes its own gate of the run
(new calls wait), waits for its own calls of the run in flight to finish, and reports
`drained.<run hash>.<instance>` with the token. The gateway that took the request waits until
every live gateway (the heartbeat bucket of `proxy/reaper.py`) has reported, and only then appends
`PhaseChanged(update)`; so no call runs on any gateway across the update. Going back to
`rollout` (or a drain that timed out) writes `open`, which releases every gateway's gate; the
`PhaseChanged` events keep doing so as well for gateways that start later.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from services.common.eventstore import EventStore
from services.gateway.phase import PhaseGate

BUCKET = "rollwire_phase"
log = logging.getLogger("rollwire.gateway.phase")


class _Request(msgspec.Struct):
    run_id: str
    state: str  # close | open
    token: str = ""


def _run_key(run_id: str) -> str:
    return hashlib.sha256(run_id.encode()).hexdigest()[:24]


class PhaseSync:
    """This gateway's part in run-wide phase switches (see the module docstring)."""

    def __init__(
        self, store: EventStore, gate: PhaseGate, instance: str, alive: Callable[[], Awaitable[set[str]]]
    ) -> None:
        self.store = store
        self.gate = gate
        self.instance = instance
        self.alive = alive
        self.kv: KeyValue | None = None
        self.drain_timeout_s = 900.0
        self.task: asyncio.Task[None] | None = None

    async def start(self, drain_timeout_s: float) -> None:
        """Open the bucket and follow close and open requests in the background."""
        self.drain_timeout_s = drain_timeout_s
        try:
            self.kv = await self.store.js.key_value(BUCKET)
        except nats.js.errors.BucketNotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                await self.store.js.create_key_value(bucket=BUCKET, history=1)
            self.kv = await self.store.js.key_value(BUCKET)
        watcher = await self.kv.watch("close.*")
        self.task = asyncio.get_running_loop().create_task(self._follow(watcher))

    async def stop(self) -> None:
        """Stop following requests."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        drains: set[asyncio.Task[None]] = set()
        async for entry in watcher:
            if entry is None or not entry.value:
                continue
            try:
                request = msgspec.json.decode(entry.value, type=_Request)
            except msgspec.DecodeError:
                continue
            if request.state == "close":
                self.gate.close(request.run_id)
                task = asyncio.get_running_loop().create_task(self._drain(request))
                drains.add(task)
                task.add_done_callback(drains.discard)
            elif request.state == "open":
                self.gate.release(request.run_id)

    async def _drain(self, request: _Request) -> None:
        if await self.gate.drain(request.run_id, self.drain_timeout_s) and self.kv is not None:
            with contextlib.suppress(nats.errors.Error):
                await self.kv.put(f"drained.{_run_key(request.run_id)}.{self.instance}", request.token.encode())

    async def close_all(self, run_id: str, timeout_s: float) -> set[str]:
        """Close the run's gate on every gateway and wait for their calls; returns the gateways still busy."""
        assert self.kv is not None
        token = secrets.token_hex(8)
        await self.kv.put(f"close.{_run_key(run_id)}", msgspec.json.encode(_Request(run_id, "close", token)))
        deadline = time.monotonic() + timeout_s
        while True:
            busy = await self._busy(run_id, token)
            if not busy or time.monotonic() > deadline:
                return busy
            await asyncio.sleep(0.05)

    async def _busy(self, run_id: str, token: str) -> set[str]:
        assert self.kv is not None
        busy = set()
        for instance in await self.alive() | {self.instance}:
            try:
                entry = await self.kv.get(f"drained.{_run_key(run_id)}.{instance}")
            except nats.js.errors.KeyNotFoundError:
                busy.add(instance)
                continue
            if (entry.value or b"").decode() != token:
                busy.add(instance)
        return busy

    async def open_all(self, run_id: str) -> None:
        """Release the run's gate on every gateway."""
        assert self.kv is not None
        await self.kv.put(f"close.{_run_key(run_id)}", msgspec.json.encode(_Request(run_id, "open")))
