"""Per-attempt budgets: how many calls, tokens, bytes and seconds one attempt may spend.

A run sets them in its spec (`budget`: `calls`, `tokens` = prompt + response tokens of the
attempt's calls, `bytes` = the size of its failed and aborted call records and of the custom
events its agent and evaluator post, `wall_s` = seconds since the attempt started). Over a
budget, a call or an event is refused before anything is forwarded or written, with a 403
(`type` `insufficient_quota`, `code` `budget_exceeded`, `param` the budget; OpenAI clients do not
retry a 403), recorded once per attempt and budget as a `budget_exceeded` custom event.

Calls are reserved at admission and settled when they end, so neither parallel calls nor
gateway replicas can pass a budget (`ledger.py` keeps the shared entry; `leases.py` lets a
gateway reserve ahead for an attempt's next calls, so that most calls write nothing):

- a call reserves one call, its prompt (the request's size in bytes, a bound on its tokens, or
  its exact ids in token-in mode) plus `n` times its `max_tokens` (the run's per-call limit when
  it sends none), and the bytes its record could take if it failed. When the tokens left do not
  cover that, its `max_tokens` is lowered to what is left; when its prompt and one token do not
  fit beside what was spent, it is refused; when they fit but calls in flight or leases hold the
  rest, it waits for them to settle (up to `HOLD_S`, then a 429 the client retries); calls and
  bytes the same way;
- at its end the reservation is replaced by what the engine spent: the prompt and response
  tokens it answered with, whether the client read the answer to its end or disconnected (an
  aborted stream is charged the tokens that reached the gateway; an abandoned call whose
  answer never came is charged its whole reservation); an engine's refusal costs no tokens.

`wall_s` is measured on the stream's clock (`ledger.StreamClock`), from the JetStream time of the
attempt's first event, so a gateway whose clock is off neither shortens nor extends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import NoReturn

import msgspec

from schemas import CustomEvent, Event
from schemas.codec import encode
from schemas.events import BUDGET_EXCEEDED_EVENT
from schemas.rollout import RolloutView
from schemas.runs import AttemptBudget
from services.common.eventstore import Appended, EventStore, EventStoreUnavailable
from services.gateway.idempotency import derive_id
from services.gateway.proxy.leases import IDLE_S, Share, lease_for
from services.gateway.proxy.ledger import Busy, Charge, Ledger, Refused, SharedLedger
from services.gateway.proxy.limits import ProxyRefusal

BUDGET_EVENT = BUDGET_EXCEEDED_EVENT
HOLD_S = 30.0
"""How long a call waits for calls in flight to give back the tokens they hold before a 429."""
log = logging.getLogger("rollwire.gateway")


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """What a call (or event) reserved, against which entry, and the `max_tokens` it was granted."""

    view: RolloutView
    attempt_id: str
    epoch: str
    charge: Charge
    max_tokens: int = 0
    key: str = ""
    """The attempt's entry key ("" for a charge never reserved)."""


def unlimited(budget: AttemptBudget) -> bool:
    """True when the run sets no budget at all (nothing is counted)."""
    return budget.calls is None and budget.tokens is None and budget.bytes is None and budget.wall_s is None


class Budgets:
    """Reserve, settle and refuse against the shared per-attempt ledger (see the module docstring)."""

    def __init__(self, store: EventStore, max_bytes: int = 16 * 1024 * 1024) -> None:
        self.store = store
        self.ledger = SharedLedger(store, max_bytes)
        self.shares: dict[str, Share] = {}
        """This gateway's part of each attempt's entry while the attempt is active here (`leases.py`)."""
        self._flushes: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        """Open the shared ledger's bucket (done at start; the first use opens it otherwise)."""
        await self.ledger.open()

    async def reserve(
        self,
        view: RolloutView,
        attempt_id: str,
        budget: AttemptBudget,
        *,
        prompt: int,
        n: int,
        max_tokens: int,
        size: int,
        calls: int = 1,
    ) -> Reservation | None:
        """Reserve a call (prompt + n * max_tokens, or less `max_tokens` when that is all that is left),
        or refuse it (ProxyRefusal 403) and record why. None when the run sets no budget.

        From this gateway's lease when it covers the whole call (no write), else by a write that also
        takes a lease for the attempt's next calls."""
        if unlimited(budget):
            return None
        now = await self.ledger.clock.now() if budget.wall_s is not None else 0.0
        started = view.attempt(attempt_id)
        fallback = started.started_at if started is not None else now
        key = self.ledger.key(view, attempt_id)
        share = self.shares.get(key) or self.shares.setdefault(key, Share(view, attempt_id))
        if share.idle is not None:
            share.idle.cancel()
            share.idle = None
        want = Charge(calls=calls, tokens=prompt + n * max_tokens, bytes=size)
        in_time = budget.wall_s is None or now - (share.started or fallback) <= budget.wall_s
        # What is not a call (a count of tokens, an event) is refused once the calls are spent: the entry decides.
        drawable = in_time and (calls > 0 or budget.calls is None)
        if drawable and share.draw(want):
            return Reservation(
                view=view, attempt_id=attempt_id, epoch=share.epoch, charge=want, max_tokens=max_tokens, key=key
            )
        granted = max_tokens

        def decide(ledger: Ledger) -> tuple[Charge, Charge]:
            nonlocal granted
            if budget.wall_s is not None:
                elapsed = now - (ledger.started if ledger.started is not None else fallback)
                if elapsed > budget.wall_s:
                    raise Refused("wall_s", budget.wall_s, round(elapsed, 3))
            granted = _granted(ledger, budget, calls=calls, prompt=prompt, n=n, max_tokens=max_tokens, size=size)
            charge = Charge(calls=calls, tokens=prompt + n * granted, bytes=size)
            return charge, lease_for(ledger, budget, charge)

        try:
            await self._admit(share, decide)
        except BaseException:
            self._idle(key, share)
            raise
        share.in_flight += 1
        charge = Charge(calls=calls, tokens=prompt + n * granted, bytes=size)
        return Reservation(
            view=view, attempt_id=attempt_id, epoch=share.epoch, charge=charge, max_tokens=granted, key=key
        )

    async def _write(self, share: Share, decide: Callable[[Ledger], tuple[Charge, Charge]]) -> Ledger:
        """Write the share's part of the attempt's entry and hold what `decide` asks on the entry as it
        then is (a call's charge, and a lease); `decide` may refuse (`Refused`, nothing is written)."""
        folded = share.snapshot()
        lease = Charge()

        def apply(ledger: Ledger) -> Ledger:
            nonlocal folded, lease
            folded, base = share.snapshot(), share.folded(ledger)
            charge, lease = decide(base)
            return base.hold(charge.plus(lease))

        share.writing += 1
        try:
            entry = await self.ledger.change(share.view, share.attempt_id, apply)
        finally:
            share.writing -= 1
        share.written(entry, folded, lease)
        return entry

    async def _admit(self, share: Share, decide: Callable[[Ledger], tuple[Charge, Charge]]) -> None:
        """Write a reservation; refuse past the budget; wait (up to `HOLD_S`) while only what others hold
        stands in the way, then answer 429 so that the client retries. While it waits, what this
        gateway owes the entry is written, so that the others waiting see what ended here."""
        deadline = time.monotonic() + HOLD_S
        pause = 0.02
        while True:
            try:
                await self._write(share, decide)
                return
            except Busy as busy:
                if share.owes:
                    with contextlib.suppress(Exception):
                        await self._write(share, _nothing)
                if time.monotonic() > deadline:
                    raise ProxyRefusal(
                        429,
                        f"attempt {share.attempt_id}'s calls in flight hold the rest of its {busy.budget} budget; "
                        "retry",
                        kind="rate_limit_error",
                        param=busy.budget,
                    ) from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
            except Refused as over:
                await self._refuse(share.view, share.attempt_id, over)

    def _idle(self, key: str, share: Share) -> None:
        """With no call of the attempt in flight here: give the lease back after `IDLE_S` (or drop an
        empty share now)."""
        if share.in_flight or share.writing or share.idle is not None:
            return
        if not share.owes:
            self.shares.pop(key, None)
            return
        share.idle = asyncio.get_running_loop().call_later(IDLE_S, self._give_back, key)

    async def settle(self, reservation: Reservation, spent: Charge, seqs: list[int]) -> None:
        """Replace a reservation by what was spent (`seqs`: the stream sequences of what was recorded).

        Kept on this gateway's share until the attempt's next write (or `IDLE_S` without a call).
        Never raises: a settlement the store cannot take leaves the reservation charged."""
        key = reservation.key
        share = self.shares.get(key) if key else None
        if share is not None and reservation.epoch and reservation.epoch == share.epoch:
            share.settled(reservation.charge, spent, seqs)
            self._idle(key, share)
            return
        try:  # reserved against an entry since rebuilt from the stream (or never): only what it did not count
            await self.ledger.change(
                reservation.view,
                reservation.attempt_id,
                lambda ledger: ledger if ledger.counted(seqs) else ledger.spend(spent),
            )
        except Exception as exc:  # the reservation stays: the attempt is charged too much, never too little
            log.warning("budget of attempt %s not settled: %r", reservation.attempt_id, exc)
        if share is not None and reservation.epoch:  # a reservation of this share's older entry has ended
            share.in_flight = max(0, share.in_flight - 1)
            self._idle(key, share)

    def _give_back(self, key: str) -> None:
        task = asyncio.get_running_loop().create_task(self._flush(key))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self, key: str) -> None:
        """Write what an idle attempt's share owes and give its lease back; the share is then dropped."""
        share = self.shares.get(key)
        if share is None:
            return
        share.idle = None
        if share.in_flight or share.writing:
            return
        try:
            await self._write(share, _nothing)
        except Exception as exc:  # left held: the attempt is charged too much until the next write, never too little
            log.warning("budget of attempt %s not written: %r", share.attempt_id, exc)
            return
        self._idle(key, share)

    async def close(self) -> None:
        """Write what every share owes and give the leases back (the gateway is stopping)."""
        for key, share in list(self.shares.items()):
            if share.idle is not None:
                share.idle.cancel()
            await self._flush(key)
        for task in list(self._flushes):
            task.cancel()

    async def charge(
        self, view: RolloutView, attempt_id: str, budget: AttemptBudget, spent: Charge, seqs: list[int]
    ) -> None:
        """Count what a call spent that was never reserved (one refused before admission, then recorded)."""
        if unlimited(budget) or spent == Charge():
            return
        await self.settle(Reservation(view=view, attempt_id=attempt_id, epoch="", charge=Charge()), spent, seqs)

    async def append_event(self, view: RolloutView, attempt_id: str, budget: AttemptBudget, event: Event) -> Appended:
        """Append an attempt's custom event within its byte budget (ProxyRefusal 403 beyond it, nothing written)."""
        size = len(encode(event))
        if budget.bytes is None:
            return await self.store.append(event)
        bytes_only = AttemptBudget(bytes=budget.bytes)
        reservation = await self.reserve(view, attempt_id, bytes_only, prompt=0, n=0, max_tokens=0, size=size, calls=0)
        assert reservation is not None
        try:
            appended = await self.store.append(event)
        except BaseException:
            await self.settle(reservation, Charge(), [])
            raise
        # A repeat of an event already appended is already counted.
        await self.settle(reservation, Charge() if appended.duplicate else reservation.charge, [appended.seq])
        return appended

    async def _refuse(self, view: RolloutView, attempt_id: str, over: Refused) -> NoReturn:
        """Record why the attempt is refused (once per budget) and answer 403."""
        message = (
            f"attempt {attempt_id} has spent its {over.budget} budget ({over.used} of {over.limit}); "
            "no more calls or events are accepted"
        )
        event = CustomEvent(
            event_id=derive_id(view.run_id, view.rollout_id, attempt_id, BUDGET_EVENT, over.budget),
            run_id=view.run_id,
            rollout_id=view.rollout_id,
            attempt_id=attempt_id,
            name=BUDGET_EVENT,
            payload={"budget": over.budget, "limit": over.limit, "used": over.used},
        )
        with contextlib.suppress(EventStoreUnavailable):
            await self.store.append(event)  # one event per attempt and budget (a repeat is a duplicate)
        raise ProxyRefusal(403, message, kind="insufficient_quota", param=over.budget, code=BUDGET_EVENT)


def _granted(
    ledger: Ledger, budget: AttemptBudget, *, calls: int, prompt: int, n: int, max_tokens: int, size: int
) -> int:
    """The `max_tokens` a call can have on this entry: refused (`Refused`) when what was spent leaves no
    room, waiting (`Busy`) when only what calls in flight and leases hold stands in the way."""
    if budget.calls is not None:
        if ledger.calls >= budget.calls:  # nothing more, a count of tokens (no call) included
            raise Refused("calls", budget.calls, ledger.calls)
        if ledger.calls + ledger.held_calls + calls > budget.calls:
            raise Busy("calls", budget.calls, ledger.calls + ledger.held_calls)
    if budget.bytes is not None:
        if ledger.bytes + size > budget.bytes:
            raise Refused("bytes", budget.bytes, ledger.bytes)
        if ledger.bytes + ledger.held_bytes + size > budget.bytes:
            raise Busy("bytes", budget.bytes, ledger.bytes + ledger.held_bytes)
    if budget.tokens is None:
        return max_tokens
    least = prompt + max(n, 1)
    if ledger.tokens + least > budget.tokens:
        raise Refused("tokens", budget.tokens, ledger.tokens)
    room = budget.tokens - ledger.tokens - ledger.held - prompt
    if room < max(n, 1):
        raise Busy("tokens", budget.tokens, ledger.tokens + ledger.held)
    return min(max_tokens, room // max(n, 1))


def _nothing(_: Ledger) -> tuple[Charge, Charge]:
    """Hold nothing more (a write that only gives back what a share owes)."""
    return Charge(), Charge()
