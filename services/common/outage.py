"""One log line per outage, not one traceback per failed attempt.

A service that retries through a NATS, Postgres or gateway outage would otherwise log every
retry (the controller once logged 161 tracebacks in one outage). `Outage` logs the first failure
of a kind as one warning line (no traceback), counts the rest quietly, and logs one line when the
thing answers again, with how long it was down and how many attempts failed.
"""

from __future__ import annotations

import logging
import time


class Outage:
    """Track one dependency's outage for logging (see the module docstring)."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log = log
        self.what = what
        self.since: float | None = None
        self.failures = 0

    @property
    def down(self) -> bool:
        """True between the first failure and the next success."""
        return self.since is not None

    def failed(self, exc: BaseException, doing: str = "") -> None:
        """A call to the dependency failed: one warning line at the start of an outage, silence after."""
        self.failures += 1
        if self.since is None:
            self.since = time.monotonic()
            action = f" ({doing})" if doing else ""
            self.log.warning("%s unavailable%s: %s: %s; retrying quietly", self.what, action, type(exc).__name__, exc)

    def ok(self) -> None:
        """A call succeeded: one line when this ends an outage."""
        if self.since is not None:
            self.log.warning(
                "%s answers again after %.1fs (%d failed attempts)",
                self.what,
                time.monotonic() - self.since,
                self.failures,
            )
        self.since = None
        self.failures = 0
