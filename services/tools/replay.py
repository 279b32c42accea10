"""Replay a past run from its events under one or more schemes; no agent runs again.

    store = await EventStore.connect(url)
    report = await replay_run(store, "r42", compare=["rollout-mean", "seq-mean-token-mean"])

The run is read group by group (`services.tools.source`), every unit goes through the adapter
under each scheme (`services.tools.report`), and with two or more schemes the rollouts' loss
weights are compared (`services.tools.compare`).

Decoding calls and merging them is CPU work, reading the stream mostly waiting and parsing. So a
large run is replayed by worker processes: this process reads a chunk of whole groups as raw
bytes and hands it to a worker, which decodes it and runs the adapter, while this process reads
the next chunk. At most `workers + 1` chunks are in flight, so memory stays bounded by the chunk
size (`budget` calls), not by the run. A small run (or `workers=0`) is replayed in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import msgspec

from services.common.eventstore import EventStore
from services.tools.compare import Comparison, compare
from services.tools.report import SchemeAccumulator, SchemeReport, UnitRows, unit_rows
from services.tools.schemes import base_config, schemes
from services.tools.source import CALL_BUDGET, RunIndex, UnitInput, index_run, plan_units, stream_chunks, unit_rollouts
from trainer.core import AdapterConfig

REPORT_VERSION = 1
PARALLEL_BUDGET = 512
"""Calls per chunk handed to a worker (smaller than in-process chunks: several are in flight)."""
MIN_PARALLEL_CALLS = 64 * PARALLEL_BUDGET
"""Below this many calls, starting worker processes costs more than it saves."""


class ReplayReport(msgspec.Struct, frozen=True, kw_only=True):
    """A replayed run: one report per scheme and, with several schemes, their comparison."""

    version: int
    run_id: str
    step: int | None
    schemes: list[SchemeReport]
    comparison: Comparison | None


def default_workers() -> int:
    """Worker processes for a large replay: one per spare CPU core, at most 8 (0 on one core)."""
    return max(0, min(8, (os.cpu_count() or 1) - 1))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a while (back on after, if it was on).

    A chunk's calls, token lists and samples form no cycles and are freed by reference counting
    as soon as each unit is done, but their millions of allocations would set off collections that
    walk every long-lived object of the process (the run's index among them): about a third of a
    100k-call replay's time.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def replay_chunk(chunk: list[UnitInput], configs: list[AdapterConfig]) -> list[list[UnitRows]]:
    """Replay a chunk of units under every config: per unit, one `UnitRows` per config (worker side)."""
    results = []
    with _collector_paused():
        for item in chunk:
            rollouts, skipped = unit_rollouts(item, configs[0].selection() if configs else None)
            results.append([unit_rows(item.unit.step, rollouts, config, skipped) for config in configs])
    return results


async def _replay_units(
    store: EventStore, index: RunIndex, accumulators: list[SchemeAccumulator], step: int | None,
    workers: int | None, budget: int | None,
) -> None:  # fmt: skip
    units = plan_units(index, step)
    order = {rid: entry.order for rid, entry in index.rollouts.items()}
    configs = [acc.config for acc in accumulators]
    calls = sum(unit.calls for unit in units)

    def collect(results: list[list[UnitRows]]) -> None:
        for per_scheme in results:
            for acc, rows in zip(accumulators, per_scheme, strict=True):
                acc.add_rows(rows, order)

    if workers is None:
        workers = default_workers() if calls >= MIN_PARALLEL_CALLS else 0
    if workers <= 0:
        async for chunk in stream_chunks(store, index, units, budget=budget or CALL_BUDGET):
            collect(replay_chunk(chunk, configs))
        return
    loop = asyncio.get_running_loop()
    # spawn: a worker must not inherit this process's event loop and NATS connection.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        in_flight: deque[asyncio.Future[list[list[UnitRows]]]] = deque()
        async for chunk in stream_chunks(store, index, units, budget=budget or PARALLEL_BUDGET):
            in_flight.append(loop.run_in_executor(pool, replay_chunk, chunk, configs))
            while len(in_flight) > workers or (in_flight and in_flight[0].done()):
                collect(await in_flight.popleft())
        while in_flight:
            collect(await in_flight.popleft())


async def replay_run(
    store: EventStore,
    run_id: str,
    *,
    options: Mapping[str, Any] | None = None,
    compare_specs: Sequence[str] = (),
    step: int | None = None,
    nats_url: str = "",
    budget: int | None = None,
    workers: int | None = None,
) -> ReplayReport:
    """Rebuild the run's samples under the base scheme and each `compare_specs` scheme.

    `options` are the command's scheme options (`merge`, `advantage`, `estimator`, `std`, `norm`,
    and the selection `agents`, `models`; None = the run's recorded adapter config, else the
    adapter's default). Every compared scheme takes the base's selection. `step` replays only the
    rollouts the trainer recorded in that step. `budget` is the calls per stream read, `workers`
    the worker processes (default: `default_workers()` for a large run, none for a small one).
    Raises `RunNotFound`, `ReplayError` or the adapter's `AdapterConfigError`, each for the user.
    """
    index = await index_run(store, run_id, nats_url=nats_url)
    base = base_config(index.recorded_adapter, options or {})
    selection = {"agents": base.agents, "models": base.models}
    compared = [
        msgspec.structs.replace(s, config=AdapterConfig.from_mapping({**msgspec.structs.asdict(s.config), **selection}))
        for s in schemes(base, compare_specs)
    ]
    accumulators = [SchemeAccumulator(scheme) for scheme in compared]
    await _replay_units(store, index, accumulators, step, default_workers() if workers is None else workers, budget)
    skipped = index.skipped()
    if step is not None:
        skipped = {rid: reason for rid, reason in skipped.items() if index.rollouts[rid].step == step}
    reports = [acc.finish(skipped) for acc in accumulators]
    return ReplayReport(
        version=REPORT_VERSION,
        run_id=run_id,
        step=step,
        schemes=reports,
        comparison=compare(reports) if len(reports) > 1 else None,
    )
