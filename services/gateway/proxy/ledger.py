"""The per-attempt ledger every gateway replica shares: one JetStream key-value entry per attempt.

An entry holds what the attempt has spent (`calls`, `tokens`, `bytes`, settled), what is held of
each by calls in flight and by gateways' leases (`held_calls`, `held` tokens, `held_bytes`; a
lease is what a gateway reserved ahead for the attempt's next calls, `leases.py`), and the stream
time its attempt started. It is only ever changed by compare-and-set on the entry's revision
(`EventStore.kv_write(last=...)`), so two gateways that admit calls of one attempt at once cannot both
take the last unit of a budget: one of them re-reads and decides again. Each process keeps the
entries it last wrote (bounded by bytes) and writes against that revision directly; a stale copy
costs one conflict and one read.

An attempt without an entry (its first call, or one whose entry expired after `TTL_S` or was
lost) is counted from the stream: its `model_request` events (prompt tokens through
`prompt_length`, so a call recorded as a reference to an earlier one counts its whole prompt),
the bytes of its failed and aborted call records and of its agent's and evaluator's custom
events. Such a build gets a fresh `epoch` and the stream sequence it read through (`upto`), so
a call reserved against an older entry settles correctly into the new one (`Ledger.settle`).

Time is the stream's: `started` is the JetStream timestamp of the attempt's first event, and
`StreamClock.now` is the JetStream server's clock (its `STREAM.INFO` timestamp, the offset to
this host's clock measured every `CLOCK_REFRESH_S`), so `wall_s` is the same whichever
gateway's clock serves the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from datetime import datetime

import msgspec
import nats.js.errors
from nats.js.kv import KeyValue

from schemas import CustomEvent, ModelRequestRecorded
from schemas.codec import MalformedEvent, decode
from schemas.ids import CUSTOM_EVENT, MODEL_REQUEST, ROLLOUT_ATTEMPT, ROLLOUT_STATUS
from schemas.refs import prompt_length, response_length
from schemas.rollout import RolloutView
from services.common.bytecache import ByteLRU
from services.common.eventstore import EventStore, EventStoreUnavailable
from services.gateway.idempotency import derive_id

BUCKET = "rollwire_budgets"
TTL_S = 14 * 24 * 3600.0
"""An entry unchanged this long expires; the attempt, if it calls again, is counted from the stream."""
CLOCK_REFRESH_S = 10.0
_ATTEMPTS = 64
_encode = msgspec.json.Encoder().encode


class Charge(msgspec.Struct, frozen=True, kw_only=True):
    """An amount of each budget: what a call reserves, or what it turned out to spend."""

    calls: int = 0
    tokens: int = 0
    bytes: int = 0

    def plus(self, other: Charge) -> Charge:
        """The two amounts added."""
        return Charge(calls=self.calls + other.calls, tokens=self.tokens + other.tokens, bytes=self.bytes + other.bytes)

    def minus(self, other: Charge) -> Charge:
        """This amount less `other`, never below zero."""
        return Charge(
            calls=max(0, self.calls - other.calls),
            tokens=max(0, self.tokens - other.tokens),
            bytes=max(0, self.bytes - other.bytes),
        )

    def least(self, other: Charge) -> Charge:
        """The smaller of the two amounts, budget by budget."""
        return Charge(
            calls=min(self.calls, other.calls),
            tokens=min(self.tokens, other.tokens),
            bytes=min(self.bytes, other.bytes),
        )

    def covers(self, other: Charge) -> bool:
        """True when this amount holds at least `other` of every budget."""
        return self.calls >= other.calls and self.tokens >= other.tokens and self.bytes >= other.bytes


class Ledger(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt's entry: calls, tokens and bytes spent, what calls in flight and leases hold of each,
    and when the attempt started (stream time)."""

    calls: int = 0
    tokens: int = 0
    bytes: int = 0
    held: int = 0
    held_calls: int = 0
    held_bytes: int = 0
    epoch: str = ""
    upto: int = 0
    started: float | None = None

    def spend(self, charge: Charge) -> Ledger:
        """This ledger with `charge` spent."""
        return msgspec.structs.replace(
            self, calls=self.calls + charge.calls, tokens=self.tokens + charge.tokens, bytes=self.bytes + charge.bytes
        )

    def hold(self, charge: Charge, sign: int = 1) -> Ledger:
        """This ledger with `charge` held (or released, sign -1; never below zero)."""
        return msgspec.structs.replace(
            self,
            held_calls=max(0, self.held_calls + sign * charge.calls),
            held=max(0, self.held + sign * charge.tokens),
            held_bytes=max(0, self.held_bytes + sign * charge.bytes),
        )

    def counted(self, seqs: list[int]) -> bool:
        """True when this entry, counted from the stream, already holds the records at `seqs`."""
        return bool(seqs) and min(seqs) <= self.upto


class StreamClock:
    """The JetStream server's clock, read through `STREAM.INFO`'s `ts` (see the module docstring)."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._offset = 0.0
        self._measured = -CLOCK_REFRESH_S

    async def now(self) -> float:
        """Unix seconds now on the stream's clock (this host's clock if the server does not say)."""
        if time.monotonic() - self._measured >= CLOCK_REFRESH_S and self.store.nc.is_connected:
            before = time.time()
            reply = await self.store.nc.request(f"$JS.API.STREAM.INFO.{self.store.stream}", b"", timeout=5)
            after = time.time()
            stamp = msgspec.json.decode(reply.data).get("ts")
            if isinstance(stamp, str):
                self._offset = parse_time(stamp) - (before + after) / 2
            self._measured = time.monotonic()
        return time.time() + self._offset


def parse_time(stamp: str) -> float:
    """Unix seconds of an RFC 3339 time as nats-server writes it (nanosecond digits allowed)."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    zone = ""
    for sign in ("+", "-"):
        if sign in frac:
            frac, zone = frac.split(sign, 1)[0], sign + frac.split(sign, 1)[1]
    whole = datetime.fromisoformat(head + (zone or "+00:00")).timestamp()
    return whole + (float(f"0.{frac}") if frac else 0.0)


def ack_meta(reply: str) -> tuple[int, float]:
    """(stream sequence, stream time in Unix seconds) from a JetStream ack subject
    (`$JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<cseq>.<ns>.<pending>`, or the form with domain and hash)."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[7]) / 1e9
    return int(tokens[7]), int(tokens[9]) / 1e9


class Refused(Exception):
    """A change would pass a budget: which one, its limit and what is used."""

    def __init__(self, budget: str, limit: float, used: float) -> None:
        super().__init__(budget)
        self.budget, self.limit, self.used = budget, limit, used


class Busy(Refused):
    """A change fits the budget only once calls in flight give back what they hold: wait for them."""


class SharedLedger:
    """Each attempt's `Ledger` in the shared bucket, changed by compare-and-set (see the module docstring)."""

    def __init__(self, store: EventStore, cache_bytes: int = 16 * 1024 * 1024) -> None:
        self.store = store
        self.clock = StreamClock(store)
        self.kv: KeyValue | None = None
        self._cache: ByteLRU[str, tuple[Ledger, int]] = ByteLRU(cache_bytes, lambda _: 256)
        self._locks: dict[str, asyncio.Lock] = {}

    async def open(self, ttl_s: float = TTL_S) -> None:
        """Open (or create) the shared bucket."""
        js = self.store.js
        try:
            self.kv = await js.key_value(BUCKET)
        except nats.js.errors.BucketNotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                await js.create_key_value(bucket=BUCKET, ttl=ttl_s, history=1)
            self.kv = await js.key_value(BUCKET)

    def key(self, view: RolloutView, attempt_id: str) -> str:
        """The attempt's key in the bucket."""
        return derive_id(view.run_id, attempt_id, "budget", length=48)

    async def change(self, view: RolloutView, attempt_id: str, apply: Callable[[Ledger], Ledger]) -> Ledger:
        """Apply `apply` to the attempt's entry by compare-and-set and return the new entry.

        `apply` may raise `Refused` (nothing is written); a refusal decided on a copy this process
        kept is decided again on the entry as read, since another gateway may have settled since."""
        if self.kv is None:
            await self.open()
        assert self.kv is not None
        key = self.key(view, attempt_id)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                return await self._change(self.kv, key, view, attempt_id, apply)
        finally:
            if not lock.locked() and self._locks.get(key) is lock:
                del self._locks[key]

    async def _change(
        self, kv: KeyValue, key: str, view: RolloutView, attempt_id: str, apply: Callable[[Ledger], Ledger]
    ) -> Ledger:
        for _ in range(_ATTEMPTS):
            cached = self._cache.get(key)
            fresh = cached is None
            if cached is None:
                cached = await self._load(kv, key, view, attempt_id)
            ledger, revision = cached
            try:
                new = apply(ledger)
            except Refused:
                if fresh:
                    raise
                self._cache.pop(key)
                continue
            try:
                revision = await self.store.kv_write(BUCKET, key, _encode(new), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                self._cache.pop(key)  # another process changed it: read it and decide again
                continue
            self._cache.put(key, (new, revision))
            return new
        raise EventStoreUnavailable(f"the budget of attempt {attempt_id} kept changing under this gateway")

    async def _load(self, kv: KeyValue, key: str, view: RolloutView, attempt_id: str) -> tuple[Ledger, int]:
        if not self.store.nc.is_connected:  # refused now, not held until NATS answers again
            raise EventStoreUnavailable(f"NATS is disconnected: the budget of attempt {attempt_id} cannot be read")
        for _ in range(_ATTEMPTS):
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                entry = await kv.get(key)
                if entry.value:
                    return msgspec.json.decode(entry.value, type=Ledger), entry.revision or 0
            built = await self.rebuild(view, attempt_id)
            try:
                return built, await kv.create(key, _encode(built))
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another process built it first: read theirs
        raise EventStoreUnavailable(f"the budget of attempt {attempt_id} could not be read")

    async def rebuild(self, view: RolloutView, attempt_id: str) -> Ledger:
        """The attempt's entry counted from the stream (see the module docstring)."""
        upto = await self.store.last_sequence()
        where = {"run": view.run_id, "rollout": view.rollout_id}
        subjects = [MODEL_REQUEST.format(**where), CUSTOM_EVENT.format(**where, name="*")]
        calls: set[str] = set()
        tokens = size = 0
        async for batch in self.store.read_raw(subjects):
            for msg in batch:
                seq, _ = ack_meta(msg.reply)
                if seq > upto:
                    continue
                try:
                    event = decode(msg.data, unpack=False)
                except MalformedEvent:
                    continue
                match event:
                    case ModelRequestRecorded() if event.attempt_id == attempt_id:
                        if event.call_id not in calls and event.status != "failed":
                            tokens += prompt_length(event)
                        calls.add(event.call_id)
                        tokens += response_length(event) if event.status != "failed" else 0
                        size += len(msg.data) if event.status != "ok" else 0
                    case CustomEvent() if event.attempt_id == attempt_id and event.source != "admin":
                        size += len(msg.data)
                    case _:
                        pass
        started = await self._started(view, attempt_id)
        return Ledger(
            calls=len(calls), tokens=tokens, bytes=size, epoch=secrets.token_hex(8), upto=upto, started=started
        )

    async def _started(self, view: RolloutView, attempt_id: str) -> float | None:
        """The stream time of the attempt's first event (its first status or its `attempt` event)."""
        where = {"run": view.run_id, "rollout": view.rollout_id}
        first: float | None = None
        async for batch in self.store.read_raw([ROLLOUT_STATUS.format(**where), ROLLOUT_ATTEMPT.format(**where)]):
            for msg in batch:
                if first is not None:
                    continue
                with contextlib.suppress(MalformedEvent):
                    if getattr(decode(msg.data), "attempt_id", None) == attempt_id:
                        first = ack_meta(msg.reply)[1]
        return first
