"""The controller's Prometheus families and the small functions the reconcile loop calls.

    rollwire_controller_executions{backend, state}              executions the controller tracks now
    rollwire_controller_status_changes_total{backend, status}   statuses it wrote (running, succeeded, ...)
    rollwire_controller_launches_total{backend}                 executions launched
    rollwire_controller_retries_total{backend}                  launches of a second or later attempt
    rollwire_controller_failures_total{backend, reason}         attempts that failed, by kind of reason
    rollwire_controller_queue_to_running_seconds{backend}       a rollout's queuing status to its running status

A failure's reason is free text for a person; the label is its kind, one of `REASONS`, so the
label set stays bounded. No label carries a run or rollout id.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import LATENCY_BUCKETS, install

REASONS = ("timeout", "exit_code", "launch", "lost", "evicted", "unschedulable", "cancelled", "config", "other")
_KINDS = (
    ("timeout", ("timed out", "deadlineexceeded", "timeout")),
    ("launch", ("cannot launch", "imagepull", "never started", "not launched", "errimage")),
    ("evicted", ("evicted", "oomkilled")),
    ("unschedulable", ("unschedulable",)),
    ("lost", ("deleted", "removed", "vanished", "died", "stopped reporting", "no execution")),
    ("cancelled", ("cancelled",)),
    ("config", ("sets no command",)),
    ("exit_code", ("exit code", "exited with code", "exit status", "killed by", "failed")),
)
MAX_TRACKED = 100_000

STATUS_CHANGES = Counter(
    "rollwire_controller_status_changes", "Rollout statuses the controller wrote.", ["backend", "status"], registry=None
)
LAUNCHES = Counter("rollwire_controller_launches", "Executions launched.", ["backend"], registry=None)
RETRIES = Counter(
    "rollwire_controller_retries", "Launches of a second or later attempt of a rollout.", ["backend"], registry=None
)
FAILURES = Counter(
    "rollwire_controller_failures", "Attempts that failed, by kind of reason.", ["backend", "reason"], registry=None
)
QUEUE_TO_RUNNING = Histogram(
    "rollwire_controller_queue_to_running_seconds",
    "From a rollout's queuing (or requeuing) status to its running status.",
    ["backend"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
_queued_at: dict[tuple[str, str], float] = {}


def kind_of(backend: str) -> str:
    """The backend's kind for a label: `kubernetes:<template digest>` counts as `kubernetes`."""
    return backend.split(":", 1)[0]


def reason_kind(reason: str | None) -> str:
    """The bounded kind of a failure reason (see `REASONS`)."""
    text = (reason or "").split("\n", 1)[0].lower()  # the backend's words, not the log lines after them
    for kind, needles in _KINDS:
        if any(needle in text for needle in needles):
            return kind
    return "other"


def launched(run_id: str, rollout_id: str, backend: str, sequence: int, queued_since: float | None) -> None:
    """An attempt's execution was launched; `queued_since` is when the rollout was queued (event time)."""
    backend = kind_of(backend)
    LAUNCHES.labels(backend).inc()
    if sequence > 1:
        RETRIES.labels(backend).inc()
    if queued_since and len(_queued_at) < MAX_TRACKED:
        _queued_at.setdefault((run_id, rollout_id), queued_since)


def status_written(run_id: str, rollout_id: str, backend: str, status: str, reason: str | None = None) -> None:
    """The controller wrote a status for a rollout."""
    STATUS_CHANGES.labels(backend, status).inc()
    queued = _queued_at.pop((run_id, rollout_id), None)
    if status == "running" and queued is not None:
        QUEUE_TO_RUNNING.labels(backend).observe(max(0.0, time.time() - queued))
    if status in ("failed", "requeuing"):
        FAILURES.labels(backend, reason_kind(reason)).inc()


class ExecutionsCollector(Collector):
    """`rollwire_controller_executions{backend, state}`, counted from the controller's view at scrape time."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[tuple[str, str]]] | None = None

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "rollwire_controller_executions",
            "Executions the controller tracks, by backend and state.",
            labels=["backend", "state"],
        )
        if self.source is not None:
            counts = Tally({(backend, phase): 0 for backend in BACKENDS for phase in PHASES})
            counts.update(self.source())
            for (backend, state), count in sorted(counts.items()):
                family.add_metric([backend, state], count)
        yield family


EXECUTIONS = ExecutionsCollector()


BACKENDS = ("local", "kubernetes")
STATUSES = ("running", "succeeded", "failed", "requeuing", "cancelled")
PHASES = ("pending", "running", "succeeded", "failed", "unknown")


def _initialize() -> None:
    """Every bounded label set at 0 from the start, so increase() and the dashboard see them before they move."""
    for backend in BACKENDS:
        LAUNCHES.labels(backend)
        RETRIES.labels(backend)
        QUEUE_TO_RUNNING.labels(backend)
        for status in STATUSES:
            STATUS_CHANGES.labels(backend, status)
        for reason in REASONS:
            FAILURES.labels(backend, reason)


def watch(executions: dict[Any, dict[str, Any]], owner: dict[Any, str]) -> None:
    """Export the controller's families, counting these executions at each scrape.

    `executions` is `{rollout: {attempt: ExecutionState}}`, `owner` is `{ExecutionKey: backend}`.
    """
    install(*FAMILIES, EXECUTIONS)
    _initialize()

    def pairs() -> Iterator[tuple[str, str]]:
        for attempts in list(executions.values()):
            for state in list(attempts.values()):
                yield kind_of(owner.get(state.key, "unknown")), state.phase

    EXECUTIONS.source = pairs


FAMILIES = (STATUS_CHANGES, LAUNCHES, RETRIES, FAILURES, QUEUE_TO_RUNNING)
