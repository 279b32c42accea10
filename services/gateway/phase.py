"""The collocated-async phase gate: hold new model calls while the trainer updates the weights.

In collocated async training, rollout and update share the GPUs. `POST /api/phase
{"phase": "update"}` closes the gate of a run: new proxy calls of that run wait (up to the hold
timeout, so the harness only sees latency), calls already in flight finish, and only then is the
`PhaseChanged(update)` event appended and the request answered, so the trainer knows no call is
running on the old weights. `{"phase": "rollout", "weights_version": n}` appends the event and
releases the held calls.

Admission is a counter per run: the check and the increment happen without an `await` between
them, so a call is either counted before the gate closes (and drained) or sees it closed.
"""

from __future__ import annotations

import asyncio
import time

from services.gateway import metrics
from services.gateway.errors import ApiError


class _RunGate:
    __slots__ = ("idle", "in_flight", "open")

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.in_flight = 0


class PhaseGate:
    """Per-run admission of proxy calls (see the module docstring)."""

    def __init__(self, hold_timeout_s: float) -> None:
        self.hold_timeout_s = hold_timeout_s
        self._runs: dict[str, _RunGate] = {}

    def _gate(self, run_id: str) -> _RunGate:
        gate = self._runs.get(run_id)
        if gate is None:
            gate = self._runs[run_id] = _RunGate()
        return gate

    def is_open(self, run_id: str) -> bool:
        """True when new calls of the run are admitted right away."""
        return self._gate(run_id).open.is_set()

    def in_flight(self, run_id: str) -> int:
        """Calls of the run being served now."""
        return self._gate(run_id).in_flight

    async def enter(self, run_id: str) -> None:
        """Admit one call, waiting while the run is in the update phase (503 after the hold timeout)."""
        gate = self._gate(run_id)
        if not gate.open.is_set():
            held = metrics.hold_started()
            try:
                await self._wait_open(gate, run_id)
            finally:
                metrics.hold_ended(held)
        gate.in_flight += 1
        gate.idle.clear()

    async def _wait_open(self, gate: _RunGate, run_id: str) -> None:
        deadline = time.monotonic() + self.hold_timeout_s
        while not gate.open.is_set():
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(gate.open.wait(), max(remaining, 0.0))
            except TimeoutError:
                raise ApiError(
                    503,
                    f"run {run_id} is updating its weights and stayed in the update phase longer than "
                    f"{self.hold_timeout_s:g}s; retry later",
                    headers={"Retry-After": "5"},
                ) from None

    def leave(self, run_id: str) -> None:
        """A call admitted by `enter` has finished (recorded or refused)."""
        gate = self._gate(run_id)
        gate.in_flight -= 1
        if gate.in_flight <= 0:
            gate.in_flight = 0
            gate.idle.set()

    def close(self, run_id: str) -> None:
        """Stop admitting new calls of the run (they wait)."""
        self._gate(run_id).open.clear()

    def release(self, run_id: str) -> None:
        """Admit calls of the run again, including those waiting."""
        self._gate(run_id).open.set()

    async def drain(self, run_id: str, timeout_s: float) -> bool:
        """Wait until no call of the run is in flight; False if some still are after `timeout_s`."""
        try:
            await asyncio.wait_for(self._gate(run_id).idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
