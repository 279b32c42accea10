"""One gateway's part of an attempt's budget entry: a lease taken ahead, and settlements not yet written.

Writing the shared entry (`ledger.py`) on every reservation and every settlement cost each call two
compare-and-set round trips to JetStream, one of them before the call could go upstream. A gateway
now reserves ahead: the write that admits a call also holds a lease for the attempt's next calls
(`lease_for`), counted in the entry as held, so no other gateway can spend it. The next calls of the
attempt on this gateway draw on the lease without a write when it covers them; a call that ends
gives back to the lease what it reserved but did not spend, and what it spent is written at the
attempt's next write. When the attempt has no call in flight here for `IDLE_S`, the gateway writes
what it owes and gives the lease back (`Budgets` does the writing).

Budgets stay exact: a lease is held in the entry, so the budget is never passed; a call that finds
the rest held (by calls in flight or by another gateway's lease) waits, and is refused only when
what was spent leaves no room. A lease never takes more than `1 / LEASE_SHARE` of what is left, so
near the end of a budget there is no lease and every call is written as before.
"""

from __future__ import annotations

import asyncio

from schemas.rollout import RolloutView
from schemas.runs import AttemptBudget
from services.gateway.proxy.ledger import Charge, Ledger

LEASE_CALLS = 16
"""The most calls a gateway reserves ahead for one attempt."""
LEASE_SHARE = 4
"""A lease takes at most this fraction (1/4) of what is left of a budget."""
IDLE_S = 0.5
"""An attempt with no call in flight on this gateway for this long writes what it owes and gives its lease back."""


class Share:
    """This gateway's part of one attempt's entry (see the module docstring)."""

    def __init__(self, view: RolloutView, attempt_id: str) -> None:
        self.view, self.attempt_id = view, attempt_id
        self.epoch = ""
        """The entry the lease was taken from ("" before the first write)."""
        self.started: float | None = None
        self.lease = Charge()
        """Held in the entry for this gateway's next calls."""
        self.release = Charge()
        """Held in the entry by calls that ended: released at the next write."""
        self.spent = Charge()
        """Spent by calls that ended: added at the next write."""
        self.first_seq: int | None = None
        """The lowest stream sequence of the records `spent` counts."""
        self.in_flight = 0
        self.writing = 0
        self.idle: asyncio.TimerHandle | None = None

    def draw(self, want: Charge) -> bool:
        """Take `want` from the lease (True), or leave it when it does not cover it or a write is under way."""
        if self.writing or not self.epoch or not self.lease.covers(want):
            return False
        self.lease = self.lease.minus(want)
        self.in_flight += 1
        return True

    def settled(self, reserved: Charge, spent: Charge, seqs: list[int]) -> None:
        """A call reserved from this share ended: what it did not spend goes back to the lease."""
        self.lease = self.lease.plus(reserved.minus(spent))
        self.release = self.release.plus(reserved.least(spent))
        self.spent = self.spent.plus(spent)
        if seqs:
            self.first_seq = min(seqs) if self.first_seq is None else min(self.first_seq, *seqs)
        self.in_flight = max(0, self.in_flight - 1)

    @property
    def owes(self) -> bool:
        """True when the entry holds something for this share (a lease, or settlements not yet written)."""
        return self.lease != Charge() or self.release != Charge() or self.spent != Charge()

    def folded(self, ledger: Ledger) -> Ledger:
        """The entry with this share's lease given back and its settlements written (nothing of it is
        in an entry rebuilt from the stream but what the stream counted: only the rest is added)."""
        if ledger.epoch == self.epoch:
            return ledger.hold(self.release.plus(self.lease), -1).spend(self.spent)
        counted = self.first_seq is not None and ledger.counted([self.first_seq])
        return ledger if counted else ledger.spend(self.spent)

    def snapshot(self) -> tuple[Charge, Charge, Charge]:
        """What a write folds in: the lease, the releases and the spending, as they are now."""
        return self.lease, self.release, self.spent

    def written(self, entry: Ledger, folded: tuple[Charge, Charge, Charge], lease: Charge) -> None:
        """A write folded `folded` in and took `lease`: what settled meanwhile stays owed."""
        old_lease, release, spent = folded
        self.lease = lease.plus(self.lease.minus(old_lease))
        self.release = self.release.minus(release)
        self.spent = self.spent.minus(spent)
        if self.spent == Charge():
            self.first_seq = None
        self.epoch = entry.epoch
        self.started = entry.started


def lease_for(ledger: Ledger, budget: AttemptBudget, charge: Charge) -> Charge:
    """What to hold ahead beside a call's `charge`: up to `LEASE_CALLS` more such calls, each budget
    at most `1 / LEASE_SHARE` of what is left of it after the call. Only what `charge` spends is
    leased (an event, which is no call, leases no calls)."""
    calls = LEASE_CALLS if charge.calls else 0
    tokens, size = LEASE_CALLS * charge.tokens, LEASE_CALLS * charge.bytes
    if budget.calls is not None:
        calls = min(calls, (budget.calls - ledger.calls - ledger.held_calls - charge.calls) // LEASE_SHARE)
    if budget.tokens is not None:
        tokens = min(tokens, (budget.tokens - ledger.tokens - ledger.held - charge.tokens) // LEASE_SHARE)
    if budget.bytes is not None:
        size = min(size, (budget.bytes - ledger.bytes - ledger.held_bytes - charge.bytes) // LEASE_SHARE)
    return Charge(calls=max(0, calls), tokens=max(0, tokens), bytes=max(0, size))
