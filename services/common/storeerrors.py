"""The event store's named errors and the JetStream codes they stand for.

Apart from `eventstore` so that its reading side (`streamread`) raises the same errors without
importing the store back; import them from `services.common.eventstore` as before.
"""

from __future__ import annotations

WRONG_LAST_SEQUENCE = 10071
STORE_FULL = frozenset({10023, 10047, 10077})
"""JetStream's codes for a store that refuses writes for lack of room: insufficient resources (10023),
insufficient storage (10047), the stream's maximum bytes reached (10077)."""


class EventStoreError(RuntimeError):
    """A problem talking to the event store; the message says what to do."""


class EventStoreUnavailable(EventStoreError):
    """No NATS server with JetStream answers at the configured URL."""


class StoreFull(EventStoreUnavailable):
    """The store refuses writes for lack of room (see `STORE_FULL`, or a disk out of space)."""

    def __init__(self, subject: str, description: str, code: int) -> None:
        super().__init__(
            f"the event store refuses writes ({description}, JetStream code {code}): it is full; "
            "free disk space or raise the stream's limits, then retry"
        )
        self.subject = subject
        self.code = code


class NotSent(EventStoreUnavailable):
    """NATS is disconnected and the event was not sent: it is certainly not stored (the reconnect buffer is off)."""


class EventTooLarge(EventStoreError):
    """An event larger than the server accepts (NATS `max_payload`): retrying cannot help."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(
            f"{subject}: the event is {size} bytes, over the event store's limit of {limit} bytes (NATS max_payload)"
        )
        self.size = size
        self.limit = limit


class ConcurrencyConflict(EventStoreError):
    """Another writer appended to the subject first (JetStream error 10071)."""

    def __init__(self, subject: str, expected: int, detail: str) -> None:
        super().__init__(f"{subject}: expected last sequence {expected}, but the stream moved on ({detail})")
        self.subject = subject
        self.expected = expected
