"""The rollout status machine: which status may follow which. Pure, shared by every writer.

(none) ─► queuing ─► preparing ─► running ─► succeeded
             │           │          │   └──► failed
             │           │          └──► requeuing ─► preparing | running   (a retry)
             └───────────┴──────────────► cancelled | failed
"""

from __future__ import annotations

from schemas.events import TERMINAL_STATUSES, RolloutStatus

ALLOWED: dict[str | None, frozenset[str]] = {
    None: frozenset({"queuing"}),
    "queuing": frozenset({"preparing", "running", "failed", "cancelled"}),
    "preparing": frozenset({"running", "requeuing", "failed", "cancelled"}),
    "running": frozenset({"succeeded", "failed", "requeuing", "cancelled"}),
    "requeuing": frozenset({"preparing", "running", "failed", "cancelled"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}


class IllegalTransition(ValueError):
    """A status change the state machine forbids; carries the current and requested status."""

    def __init__(self, current: str | None, requested: str) -> None:
        allowed = sorted(ALLOWED.get(current, frozenset()))
        super().__init__(
            f"cannot move a rollout from {current or 'nothing'!s} to {requested}; "
            f"allowed next: {', '.join(allowed) or 'none (terminal)'}"
        )
        self.current = current
        self.requested = requested


def check_transition(current: str | None, requested: RolloutStatus) -> None:
    """Raise `IllegalTransition` unless `requested` may follow `current`."""
    if requested not in ALLOWED.get(current, frozenset()):
        raise IllegalTransition(current, requested)


def is_terminal(status: str | None) -> bool:
    """True for succeeded, failed and cancelled: nothing follows them."""
    return status in TERMINAL_STATUSES
