"""The embedded engine's Prometheus families, fed by the generation thread and read at scrape time.

    rollwire_engine_generated_tokens_total   tokens sampled (rate() of it is tokens/s)
    rollwire_engine_prompt_tokens_total      prompt tokens prefilled
    rollwire_engine_batch_size               rows advanced together per generation step (histogram)
    rollwire_engine_step_seconds             time of one generation step (histogram)
    rollwire_engine_running_requests         requests submitted and not yet finished
    rollwire_engine_queued_requests          requests waiting for the generation thread to admit them
    rollwire_engine_weights_version          the weights version new requests run on

prometheus_client's counters are thread-safe, so the generation thread counts directly; the gauges
read the engine when Prometheus scrapes (the newest engine in the process is the one exported).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import install

GENERATED = Counter("rollwire_engine_generated_tokens", "Tokens sampled by the engine.", registry=None)
PROMPT = Counter("rollwire_engine_prompt_tokens", "Prompt tokens prefilled by the engine.", registry=None)
BATCH_SIZE = Histogram(
    "rollwire_engine_batch_size",
    "Rows advanced together in one generation step.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    registry=None,
)
STEP_SECONDS = Histogram(
    "rollwire_engine_step_seconds",
    "Time of one generation step (one token for every row of a batch).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    registry=None,
)
RUNNING = Gauge("rollwire_engine_running_requests", "Requests submitted and not yet finished.", registry=None)
QUEUED = Gauge(
    "rollwire_engine_queued_requests", "Requests waiting for the generation thread to admit them.", registry=None
)
WEIGHTS_VERSION = Gauge("rollwire_engine_weights_version", "The weights version new requests run on.", registry=None)


def admitted(prompt_tokens: int, first_tokens: int) -> None:
    """A request was prefilled: its prompt tokens and the first token of each choice."""
    PROMPT.inc(prompt_tokens)
    GENERATED.inc(first_tokens)


def stepped(rows: int, seconds: float) -> None:
    """One generation step advanced `rows` rows by one token each."""
    GENERATED.inc(rows)
    BATCH_SIZE.observe(rows)
    STEP_SECONDS.observe(seconds)


def watch(running: Callable[[], int], queued: Callable[[], int], weights_version: Callable[[], int]) -> None:
    """Export the engine's families, reading these engine figures at each scrape."""
    install(*FAMILIES)
    RUNNING.set_function(lambda: float(running()))
    QUEUED.set_function(lambda: float(queued()))
    WEIGHTS_VERSION.set_function(lambda: float(weights_version()))


FAMILIES = (GENERATED, PROMPT, BATCH_SIZE, STEP_SECONDS, RUNNING, QUEUED, WEIGHTS_VERSION)
