"""Per-attempt budgets: how many calls, tokens and seconds one attempt may spend through the proxy.

A run sets them in its spec (`budget`: `calls`, `tokens` = prompt + response tokens of the
attempt's recorded calls, `wall_s` = seconds since the attempt started). The proxy asks
`Budgets.admit` before forwarding a call and tells `Budgets.record` about every call it records.
A call over budget is refused with a 403 in OpenAI's error shape (`type` `insufficient_quota`,
`code` `budget_exceeded`; OpenAI clients do not retry a 403) and recorded once per attempt and
budget as a `budget_exceeded` custom event of the attempt, which the runaway monitor reports.

The ledger is per gateway process and bounded by bytes; an attempt it does not know (first call
here, or evicted) is counted again from its `model_request` events. Calls are reserved at
admission, so concurrent calls cannot pass the call budget; the token budget is checked against
the calls recorded so far, so the call that crosses it is the last one admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from schemas import CustomEvent, ModelRequestRecorded
from schemas.events import BUDGET_EXCEEDED_EVENT
from schemas.ids import MODEL_REQUEST
from schemas.rollout import RolloutView
from schemas.runs import AttemptBudget
from services.common.bytecache import ByteLRU
from services.common.eventstore import EventStore, EventStoreUnavailable
from services.gateway.idempotency import derive_id
from services.gateway.limits import ProxyRefusal

BUDGET_EVENT = BUDGET_EXCEEDED_EVENT


class Spent(msgspec.Struct):
    """What one attempt has spent: calls recorded (plus those admitted and in flight) and tokens."""

    call_ids: set[str] = msgspec.field(default_factory=set)
    in_flight: int = 0
    tokens: int = 0


class Budgets:
    """The per-attempt ledger (see the module docstring)."""

    def __init__(self, store: EventStore, max_bytes: int = 16 * 1024 * 1024) -> None:
        self.store = store
        self._ledger: ByteLRU[tuple[str, str], Spent] = ByteLRU(max_bytes, lambda s: 48 * len(s.call_ids))
        self._loads: dict[tuple[str, str], asyncio.Future[Spent]] = {}

    async def admit(self, view: RolloutView, attempt_id: str, budget: AttemptBudget) -> bool:
        """Reserve one call of the attempt, or refuse it (ProxyRefusal 403) and record why.

        Returns True when a call was reserved (pair it with `release`)."""
        if budget.calls is None and budget.tokens is None and budget.wall_s is None:
            return False
        attempt = view.attempt(attempt_id)
        if budget.wall_s is not None and attempt is not None:
            elapsed = time.time() - attempt.started_at
            if elapsed > budget.wall_s:
                await self._refuse(view, attempt_id, "wall_s", budget.wall_s, round(elapsed, 3))
        spent = await self._spent(view, attempt_id)
        calls = len(spent.call_ids) + spent.in_flight
        if budget.calls is not None and calls >= budget.calls:
            await self._refuse(view, attempt_id, "calls", budget.calls, calls)
        if budget.tokens is not None and spent.tokens >= budget.tokens:
            await self._refuse(view, attempt_id, "tokens", budget.tokens, spent.tokens)
        spent.in_flight += 1
        return True

    def release(self, view: RolloutView, attempt_id: str) -> None:
        """The reserved call is over (recorded or not)."""
        spent = self._ledger.get((view.run_id, attempt_id))
        if spent is not None and spent.in_flight > 0:
            spent.in_flight -= 1

    def record(self, events: list[ModelRequestRecorded]) -> None:
        """Count recorded calls into the ledger of attempts it holds."""
        for event in events:
            spent = self._ledger.get((event.run_id, event.attempt_id or ""))
            if spent is not None:
                _count(spent, event)
                self._ledger.resize((event.run_id, event.attempt_id or ""))

    async def _spent(self, view: RolloutView, attempt_id: str) -> Spent:
        key = (view.run_id, attempt_id)
        spent = self._ledger.get(key)
        if spent is not None:
            return spent
        pending = self._loads.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._loads[key] = pending
            try:
                loaded = Spent()
                subject = MODEL_REQUEST.format(run=view.run_id, rollout=view.rollout_id)
                async for stored in self.store.read(subject):
                    if isinstance(stored.event, ModelRequestRecorded) and stored.event.attempt_id == attempt_id:
                        _count(loaded, stored.event)
                self._ledger.put(key, loaded)
                pending.set_result(loaded)
            except BaseException as exc:
                pending.set_exception(exc)
                pending.exception()
                raise
            finally:
                self._loads.pop(key, None)
        return await asyncio.shield(pending)

    async def _refuse(self, view: RolloutView, attempt_id: str, budget: str, limit: float, used: float) -> None:
        message = f"attempt {attempt_id} has spent its {budget} budget ({used} of {limit}); no more calls are accepted"
        event = CustomEvent(
            event_id=derive_id(view.run_id, view.rollout_id, attempt_id, BUDGET_EVENT, budget),
            run_id=view.run_id,
            rollout_id=view.rollout_id,
            attempt_id=attempt_id,
            name=BUDGET_EVENT,
            payload={"budget": budget, "limit": limit, "used": used},
        )
        with contextlib.suppress(EventStoreUnavailable):
            await self.store.append(event)  # one event per attempt and budget (a repeat is a duplicate)
        raise ProxyRefusal(403, message, kind="insufficient_quota", param=budget, code=BUDGET_EVENT)


def _count(spent: Spent, event: ModelRequestRecorded) -> None:
    """A call's prompt counts once, each of its choices' responses once."""
    first = event.call_id not in spent.call_ids
    spent.call_ids.add(event.call_id)
    if event.status == "ok":
        spent.tokens += (len(event.prompt_ids) if first else 0) + len(event.response_ids)
