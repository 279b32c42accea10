"""The gateway's Prometheus families and the small functions the proxy, gate and app call.

Families (all on the process registry, served at `GET /metrics` by `services.common.metrics`):

    rollwire_gateway_proxy_calls_total{front_end, status}          proxy calls answered
    rollwire_gateway_proxy_call_duration_seconds{front_end}        arrival to last byte
    rollwire_gateway_proxy_time_to_first_token_seconds{front_end}  streams: arrival to the first token chunk
    rollwire_gateway_recorded_calls_total{status}                  model_request events appended (ok, failed, aborted)
    rollwire_gateway_record_failures_total                         calls whose model_request could not be appended
    rollwire_gateway_phase_held_calls                              calls waiting at a closed phase gate now
    rollwire_gateway_phase_holds_total / _hold_seconds             calls that had to wait, and how long
    rollwire_gateway_idempotency_cache_entries / _bytes            the in-process idempotency cache

`front_end` is the API a call came through (`chat_completions`, `responses`, `anthropic_messages`,
`anthropic_count_tokens`, `models`, or `other`), read from the call's parsed route (an agent named
in the path included); no label carries a run, rollout or attempt id.
Time to first token is measured at the proxy's edge: the first streamed chunk that carries
generated text or a tool call (a chunk with only the role does not count).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS, HttpObserver, Message, Scope, Send, install

UNMATCHED_ROUTE = "/proxy/unmatched"
# A streamed chunk that carries generation: OpenAI chat deltas with text or tool calls, Responses API
# deltas, Anthropic content block deltas (msgspec and json.dumps(separators) write no spaces).
_TOKEN_CHUNK = re.compile(
    rb'"(?:content|reasoning_content)": ?"[^"]|"tool_calls": ?\['
    rb"|output_text\.delta|arguments\.delta|content_block_delta"
)


class Served(NamedTuple):
    """A route the proxy serves, as its metrics label it: its front end and its route template (made once
    per route, beside its handler, in `proxy.handler.ROUTES`)."""

    front_end: str
    route: str


PROXY_CALLS = Counter(
    "rollwire_gateway_proxy_calls",
    "Proxy calls answered, by front end and status code.",
    ["front_end", "status"],
    registry=None,
)
PROXY_DURATION = Histogram(
    "rollwire_gateway_proxy_call_duration_seconds",
    "Proxy calls: arrival to the last byte of the answer.",
    ["front_end"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
PROXY_TTFT = Histogram(
    "rollwire_gateway_proxy_time_to_first_token_seconds",
    "Streamed proxy calls: arrival to the first chunk carrying generated tokens.",
    ["front_end"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
RECORDED = Counter(
    "rollwire_gateway_recorded_calls", "model_request events appended, by call status.", ["status"], registry=None
)
RECORD_FAILURES = Counter(
    "rollwire_gateway_record_failures", "Model calls whose model_request events could not be appended.", registry=None
)
HELD = Gauge("rollwire_gateway_phase_held_calls", "Proxy calls waiting at a closed phase gate now.", registry=None)
HOLDS = Counter("rollwire_gateway_phase_holds", "Proxy calls that waited at a closed phase gate.", registry=None)
HOLD_SECONDS = Histogram(
    "rollwire_gateway_phase_hold_seconds",
    "How long held calls waited at the phase gate.",
    buckets=LATENCY_BUCKETS,
    registry=None,
)
IDEMPOTENCY_ENTRIES = Gauge(
    "rollwire_gateway_idempotency_cache_entries", "Keys in the idempotency cache.", registry=None
)
IDEMPOTENCY_BYTES = Gauge(
    "rollwire_gateway_idempotency_cache_bytes",
    "Bytes the idempotency cache holds (keys and responses; its bound).",
    registry=None,
)


class CallWatch:
    """One proxy call's answer as it leaves: its status, whether it streams, when its first token went.

    `send` is the one wrapper around the server's `send` on the proxy's path; `answered` then counts
    and times the call on the proxy's and the HTTP families and writes its access line.
    """

    __slots__ = ("began", "first_token", "status", "streaming", "to_client")

    def __init__(self, send: Send) -> None:
        self.began = time.perf_counter()
        self.to_client = send
        self.status: int | None = None
        self.streaming = False
        self.first_token: float | None = None

    async def send(self, message: Message) -> None:
        """Note what the message says about the answer, then send it."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name == b"content-type":
                    self.streaming = value.startswith(b"text/event-stream")
        elif self.streaming and self.first_token is None and _TOKEN_CHUNK.search(message.get("body", b"")):
            self.first_token = time.perf_counter() - self.began
        await self.to_client(message)

    def answered(self, scope: Scope, http: HttpObserver, served: Served | None) -> None:
        """Record the call (`served`: its route when the proxy serves that route)."""
        elapsed = time.perf_counter() - self.began
        status = 500 if self.status is None else self.status  # what the client got when nothing was sent
        kind = "other" if served is None else served.front_end
        calls = _calls.get((kind, status))
        if calls is None:
            calls = _calls[(kind, status)] = PROXY_CALLS.labels(kind, str(status))
        calls.inc()
        timers = _timers.get(kind)
        if timers is None:
            timers = _timers[kind] = (PROXY_DURATION.labels(kind), PROXY_TTFT.labels(kind))
        timers[0].observe(elapsed)
        if self.first_token is not None:
            timers[1].observe(self.first_token)
        route = UNMATCHED_ROUTE if served is None else served.route
        http.observe(scope["method"], scope["path"], route, status, elapsed)


# Label children made once (bounded: front ends x statuses), not on every call.
_calls: dict[tuple[str, int], Any] = {}
_timers: dict[str, tuple[Any, Any]] = {}


def recorded(events: Sequence[Any]) -> None:
    """model_request events were appended (one per choice; counted once per call)."""
    if events:
        status = getattr(events[0], "status", "ok")
        counter = _recorded.get(status)
        if counter is None:
            counter = _recorded[status] = RECORDED.labels(status)
        counter.inc()


_recorded: dict[str, Any] = {}  # label children of RECORDED, looked up once per status


def record_failed() -> None:
    """A call's model_request events could not be appended."""
    RECORD_FAILURES.inc()


def hold_started() -> float:
    """A call starts waiting at a closed gate; returns the start time for `hold_ended`."""
    HELD.inc()
    HOLDS.inc()
    return time.monotonic()


def hold_ended(started: float) -> None:
    """A held call was released (or gave up)."""
    HELD.dec()
    HOLD_SECONDS.observe(time.monotonic() - started)


def export(
    front_ends: Iterable[str], idempotency_entries: Callable[[], int], idempotency_bytes: Callable[[], int]
) -> None:
    """Export the gateway's families: each of `front_ends`' series and each record status at 0 from the
    start (bounded label sets), the idempotency cache's size read at each scrape (newest app wins)."""
    install(*FAMILIES)
    for kind in front_ends:
        PROXY_CALLS.labels(kind, "200")
        PROXY_DURATION.labels(kind)
        PROXY_TTFT.labels(kind)
    for status in ("ok", "failed", "aborted"):
        RECORDED.labels(status)
    IDEMPOTENCY_ENTRIES.set_function(lambda: float(idempotency_entries()))
    IDEMPOTENCY_BYTES.set_function(lambda: float(idempotency_bytes()))


FAMILIES = (
    PROXY_CALLS,
    PROXY_DURATION,
    PROXY_TTFT,
    RECORDED,
    RECORD_FAILURES,
    HELD,
    HOLDS,
    HOLD_SECONDS,
    IDEMPOTENCY_ENTRIES,
    IDEMPOTENCY_BYTES,
)
