"""`rollwire up` keeps its children alive: a process that dies is restarted, with backoff.

Every child (nats-server, Postgres and each service) is watched. One that exits is started again
after a delay that doubles on each consecutive fast failure (0.5 s, 1 s, 2 s, ... up to 30 s), with
one line on the console for the exit and one for the restart. A child that stayed up for
`FAST_S` seconds is healthy again: its next exit starts the backoff over. Only repeated fast
failure (`MAX_FAST` exits in a row, each within `FAST_S` of its start) stops the stack, and the
line says which child, how often and where its log is.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FAST_S = 10.0
MAX_FAST = 5
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0


@dataclass
class Unit:
    """One supervised process: how to see it and how to start it again."""

    name: str
    process: Callable[[], subprocess.Popen[bytes] | None]
    restart: Callable[[], None]
    log: Path
    started_at: float = 0.0
    fast_failures: int = 0
    restart_due: float | None = None


class Supervisor:
    """Restart dead children with backoff; `tick` returns the reason to stop the stack, if any."""

    def __init__(self, units: list[Unit], say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.units = units
        self.say = say
        self.clock = clock
        now = clock()
        for unit in units:
            unit.started_at = now

    def tick(self) -> str | None:
        """Check every child once: schedule restarts, perform the due ones; a reason to stop, or None."""
        now = self.clock()
        for unit in self.units:
            if unit.restart_due is not None:
                failed = self._restart(unit) if now >= unit.restart_due else None
                if failed is not None:
                    return failed
                continue
            proc = unit.process()
            code = proc.poll() if proc is not None else None
            if proc is None or code is None:
                continue
            reason = self._exited(unit, code, now)
            if reason is not None:
                return reason
        return None

    def _exited(self, unit: Unit, code: int | str, now: float) -> str | None:
        fast = now - unit.started_at < FAST_S
        unit.fast_failures = unit.fast_failures + 1 if fast else 1
        if fast and unit.fast_failures >= MAX_FAST:
            return (
                f"{unit.name} exited with code {code} {unit.fast_failures} times in a row, each within "
                f"{FAST_S:g}s of starting; stopping the stack (log: {unit.log})"
            )
        delay = min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (unit.fast_failures - 1))
        self.say(f"{unit.name} exited with code {code}; restarting in {delay:g}s (log: {unit.log})")
        unit.restart_due = now + delay
        return None

    def _restart(self, unit: Unit) -> str | None:
        unit.restart_due = None
        unit.started_at = self.clock()
        try:
            unit.restart()
        except Exception as exc:  # a start that fails is a fast failure like any other
            self.say(f"{unit.name} could not be restarted: {exc}")
            return self._exited(unit, "unknown (it did not start)", self.clock())
        proc = unit.process()
        self.say(f"{unit.name} restarted" + (f" (pid {proc.pid})" if proc is not None else ""))
        return None
