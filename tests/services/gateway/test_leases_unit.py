"""The lease arithmetic of `proxy/leases.py` on its own: what a gateway may hold ahead, what it gives back,
and what a write leaves owed when calls end while it travels."""

from __future__ import annotations

from schemas.rollout import RolloutView
from schemas.runs import AttemptBudget
from services.gateway.proxy.leases import LEASE_CALLS, Share, lease_for
from services.gateway.proxy.ledger import Charge, Ledger

CALL = Charge(calls=1, tokens=100, bytes=1000)


def _share() -> Share:
    share = Share(RolloutView(run_id="run", rollout_id="r"), "a")
    share.written(Ledger(epoch="e1"), share.snapshot(), Charge(calls=2, tokens=200, bytes=2000))
    return share


def test_a_lease_takes_a_quarter_of_what_is_left_and_nothing_near_the_end() -> None:
    assert lease_for(Ledger(), AttemptBudget(calls=5), CALL).calls == 1
    assert lease_for(Ledger(calls=3), AttemptBudget(calls=5), CALL).calls == 0
    assert lease_for(Ledger(held_calls=2), AttemptBudget(calls=5), CALL).calls == 0
    unlimited = lease_for(Ledger(), AttemptBudget(wall_s=10), CALL)
    assert unlimited == Charge(calls=LEASE_CALLS, tokens=LEASE_CALLS * 100, bytes=LEASE_CALLS * 1000)
    tokens = lease_for(Ledger(tokens=500, held=100), AttemptBudget(tokens=1000), CALL)
    assert tokens.tokens == (1000 - 500 - 100 - 100) // 4
    event = lease_for(Ledger(), AttemptBudget(bytes=10_000), Charge(bytes=100))  # an event is no call
    assert event == Charge(bytes=LEASE_CALLS * 100)


def test_a_call_draws_only_what_the_lease_covers_and_never_during_a_write() -> None:
    share = _share()
    assert share.draw(CALL) and share.lease == CALL and share.in_flight == 1
    assert not share.draw(Charge(calls=1, tokens=101))
    share.writing = 1
    assert not share.draw(CALL)


def test_what_a_call_did_not_spend_goes_back_to_the_lease_and_the_rest_is_owed() -> None:
    share = _share()
    assert share.draw(CALL)
    share.settled(CALL, Charge(calls=1, tokens=40, bytes=0), [7])
    assert share.lease == Charge(calls=1, tokens=160, bytes=2000)
    assert share.release == Charge(calls=1, tokens=40) and share.spent == Charge(calls=1, tokens=40)
    entry = Ledger(epoch="e1", held_calls=2, held=200, held_bytes=2000)
    folded = share.folded(entry)
    assert (folded.calls, folded.tokens, folded.held_calls, folded.held, folded.held_bytes) == (1, 40, 0, 0, 0)


def test_calls_that_end_while_a_write_travels_stay_owed() -> None:
    share = _share()
    assert share.draw(CALL)
    before = share.snapshot()  # the write folds in what is owed now ...
    share.settled(CALL, Charge(calls=1, tokens=30), [9])  # ... and this call ends before its ack
    share.written(Ledger(epoch="e1"), before, Charge(calls=3))
    assert share.spent == Charge(calls=1, tokens=30) and share.release == Charge(calls=1, tokens=30)
    assert share.lease == Charge(calls=3, tokens=70, bytes=1000)


def test_an_entry_rebuilt_from_the_stream_gets_only_what_it_did_not_count() -> None:
    share = _share()
    assert share.draw(CALL)
    share.settled(CALL, Charge(calls=1, tokens=30), [9])
    assert share.folded(Ledger(epoch="e2", upto=9)).calls == 0  # the rebuild read the record at 9
    assert share.folded(Ledger(epoch="e2", upto=8)).calls == 1
