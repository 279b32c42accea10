"""The projector's Prometheus families, read from its `Status` at scrape time.

The names are the ones the projector always exported (`rollwire_projector_lag_events{stream}`, ...),
now produced by `prometheus_client` on the process registry, next to the HTTP and process metrics
(`api.py` serves them at `GET /metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import install
from services.projector.status import Status


class StatusCollector(Collector):
    """Yields the projector's gauges and counters from the status it is watching (none: nothing)."""

    def __init__(self) -> None:
        self.status: Status | None = None

    def collect(self) -> Iterator[Metric]:
        status = self.status
        if status is None:
            return
        gauges = [
            ("applied_seq", "Last stream sequence applied to Postgres.", status.applied_seq),
            ("stream_seq", "Last sequence in the stream.", status.stream_seq),
            ("lag_events", "Stream sequence minus applied sequence.", status.lag_events),
            ("lag_seconds", "Age of the oldest event not yet applied (0 when caught up).", status.lag_seconds),
            ("dead_letters", "Messages recorded in the dead-letter table.", status.dead_letters),
            ("postgres_up", "1 when the last Postgres operation succeeded.", int(status.postgres_up)),
            ("nats_up", "1 when NATS answers.", int(status.nats_up)),
            ("last_scrape_timestamp_seconds", "When these values were read.", round(time.time(), 3)),
        ]
        counters = [
            ("events", "Events applied to Postgres.", status.events_total),
            ("batches", "Transactions committed.", status.batches_total),
            ("batch_seconds", "Time spent in committed transactions.", status.batch_seconds_total),
        ]
        for name, help_text, value in gauges:
            gauge = GaugeMetricFamily(f"rollwire_projector_{name}", help_text, labels=["stream"])
            gauge.add_metric([status.stream], value)
            yield gauge
        for name, help_text, value in counters:
            counter = CounterMetricFamily(f"rollwire_projector_{name}", help_text, labels=["stream"])
            counter.add_metric([status.stream], value)
            yield counter


COLLECTOR = StatusCollector()


def watch(status: Status) -> None:
    """Export this status from now on (a process runs one projector)."""
    install(COLLECTOR)
    COLLECTOR.status = status
