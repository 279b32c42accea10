"""What the projector reports about itself: lag, throughput, health (`metrics.py` exports it to Prometheus)."""

from __future__ import annotations

from collections import deque

import msgspec


class Health(msgspec.Struct, kw_only=True):
    """The `/healthz` body."""

    status: str
    stream: str
    applied_seq: int
    stream_seq: int
    lag_events: int
    lag_seconds: float
    postgres: str
    nats: str
    events_total: int
    dead_letters: int
    last_error: str | None


class Status:
    """Counters and gauges the service updates and the HTTP endpoint reads."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.applied_seq = 0
        self.stream_seq = 0
        self.lag_seconds = 0.0
        self.postgres_up = False
        self.nats_up = False
        self.events_total = 0
        self.batches_total = 0
        self.batch_seconds_total = 0.0
        self.dead_letters = 0
        self.last_error: str | None = None
        # (last seq, stream time of first message) of each fetched batch not yet applied, oldest first.
        self.in_flight: deque[tuple[int, float]] = deque()

    def fetched(self, last_seq: int, first_time: float) -> None:
        """A batch was fetched and queued."""
        self.in_flight.append((last_seq, first_time))

    def applied(self, seq: int, events: int, seconds: float) -> None:
        """A transaction up to `seq` committed."""
        self.applied_seq = max(self.applied_seq, seq)
        self.stream_seq = max(self.stream_seq, seq)
        self.events_total += events
        self.batches_total += 1
        self.batch_seconds_total += seconds
        while self.in_flight and self.in_flight[0][0] <= seq:
            self.in_flight.popleft()
        self.postgres_up = True
        self.last_error = None

    def reset_in_flight(self) -> None:
        """Fetched batches were dropped (the consumer restarts from the stored position)."""
        self.in_flight.clear()

    def oldest_unapplied_time(self) -> float | None:
        """Stream time of the oldest fetched message not yet applied, if any is in flight."""
        return self.in_flight[0][1] if self.in_flight else None

    @property
    def lag_events(self) -> int:
        return max(0, self.stream_seq - self.applied_seq)

    def health(self) -> Health:
        """The health report; `status` is "ok" only when both Postgres and NATS answer."""
        ok = self.postgres_up and self.nats_up
        return Health(
            status="ok" if ok else "degraded",
            stream=self.stream,
            applied_seq=self.applied_seq,
            stream_seq=self.stream_seq,
            lag_events=self.lag_events,
            lag_seconds=round(self.lag_seconds, 3),
            postgres="up" if self.postgres_up else "down",
            nats="up" if self.nats_up else "down",
            events_total=self.events_total,
            dead_letters=self.dead_letters,
            last_error=self.last_error,
        )
