"""Per-attempt budgets: how many calls, tokens, bytes and seconds one attempt may spend.

A run sets them in its spec (`budget`: `calls`, `tokens` = prompt + response tokens of the
attempt's calls, `bytes` = the size of its failed and aborted call records and of the custom
events its agent and evaluator post, `wall_s` = seconds since the attempt started). Over a
budget, a call or an event is refused before anything is forwarded or written, with a 403
(`type` `insufficient_quota`, `code` `budget_exceeded`, `param` the budget; OpenAI clients do not
retry a 403), recorded once per attempt and budget as a `budget_exceeded` custom event.

Calls are reserved at admission and settled when they end, so neither parallel calls nor
gateway replicas can pass a budget (`ledger.py` keeps the shared entry):

- a call reserves one call, its prompt (the request's size in bytes, a bound on its tokens, or
  its exact ids in token-in mode) plus `n` times its `max_tokens` (the run's per-call limit when
  it sends none), and the bytes its record could take if it failed. When the tokens left do not
  cover that, its `max_tokens` is lowered to what is left; when its prompt and one token do not
  fit beside what was spent, it is refused; when they fit but calls in flight hold the rest, it
  waits for them to settle (up to `HOLD_S`, then a 429 the client retries);
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


def unlimited(budget: AttemptBudget) -> bool:
    """True when the run sets no budget at all (nothing is counted)."""
    return budget.calls is None and budget.tokens is None and budget.bytes is None and budget.wall_s is None


class Budgets:
    """Reserve, settle and refuse against the shared per-attempt ledger (see the module docstring)."""

    def __init__(self, store: EventStore, max_bytes: int = 16 * 1024 * 1024) -> None:
        self.store = store
        self.ledger = SharedLedger(store, max_bytes)

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
        or refuse it (ProxyRefusal 403) and record why. None when the run sets no budget."""
        if unlimited(budget):
            return None
        now = await self.ledger.clock.now() if budget.wall_s is not None else 0.0
        started = view.attempt(attempt_id)
        fallback = started.started_at if started is not None else now
        granted = max_tokens

        def apply(ledger: Ledger) -> Ledger:
            nonlocal granted
            if budget.wall_s is not None:
                elapsed = now - (ledger.started if ledger.started is not None else fallback)
                if elapsed > budget.wall_s:
                    raise Refused("wall_s", budget.wall_s, round(elapsed, 3))
            if budget.calls is not None and ledger.calls >= budget.calls:
                raise Refused("calls", budget.calls, ledger.calls)
            if budget.bytes is not None and ledger.bytes + size > budget.bytes:
                raise Refused("bytes", budget.bytes, ledger.bytes)
            granted = max_tokens
            if budget.tokens is not None:
                least = prompt + max(n, 1)
                if ledger.tokens + least > budget.tokens:
                    raise Refused("tokens", budget.tokens, ledger.tokens)
                room = budget.tokens - ledger.tokens - ledger.held - prompt
                if room < max(n, 1):
                    raise Busy("tokens", budget.tokens, ledger.tokens + ledger.held)
                granted = min(max_tokens, room // max(n, 1))
            return ledger.reserve(Charge(calls=calls, tokens=prompt + n * granted, bytes=size))

        entry = await self._admit(view, attempt_id, apply)
        charge = Charge(calls=calls, tokens=prompt + n * granted, bytes=size)
        return Reservation(view=view, attempt_id=attempt_id, epoch=entry.epoch, charge=charge, max_tokens=granted)

    async def _admit(self, view: RolloutView, attempt_id: str, apply: Callable[[Ledger], Ledger]) -> Ledger:
        """Apply a reservation; refuse past the budget; wait (up to `HOLD_S`) while only calls in flight
        stand in the way, then answer 429 so that the client retries."""
        deadline = time.monotonic() + HOLD_S
        pause = 0.02
        while True:
            try:
                return await self.ledger.change(view, attempt_id, apply)
            except Busy as busy:
                if time.monotonic() > deadline:
                    raise ProxyRefusal(
                        429,
                        f"attempt {attempt_id}'s calls in flight hold the rest of its {busy.budget} budget; retry",
                        kind="rate_limit_error",
                        param=busy.budget,
                    ) from None
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
            except Refused as over:
                await self._refuse(view, attempt_id, over)

    async def settle(self, reservation: Reservation, spent: Charge, seqs: list[int]) -> None:
        """Replace a reservation by what was spent (`seqs`: the stream sequences of what was recorded).

        Never raises: a settlement the store cannot take leaves the reservation charged."""
        if spent == reservation.charge and self.ledger.holds(
            reservation.view, reservation.attempt_id, reservation.epoch
        ):
            return
        try:
            await self.ledger.change(
                reservation.view,
                reservation.attempt_id,
                lambda ledger: ledger.settle(reservation.epoch, reservation.charge, spent, seqs),
            )
        except Exception as exc:  # the reservation stays: the attempt is charged too much, never too little
            log.warning("budget of attempt %s not settled: %r", reservation.attempt_id, exc)

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
