"""Replay a past run from its events under one or more schemes; no agent runs again.

    store = await EventStore.connect(url)
    report = await replay_run(store, "r42", compare=["rollout-mean", "seq-mean-token-mean"])

The run is read group by group (`services.tools.source`), every unit goes through the adapter
under each scheme (`services.tools.report`; schemes that merge alike share one merge), and with
two or more schemes the rollouts' loss weights are compared (`services.tools.compare`).

Reading the stream (the NATS client parses every message), decoding calls and merging them are
all CPU work in this process's one thread. So a large run is replayed by worker processes, each
doing all of it for its share: the planned units are cut into as many runs of consecutive units
as there are workers, of about equal calls, and each worker reads the stream from its share's
first rollout on (its own connection) until its share's last call, replaying units as they
complete. The shares' reads overlap only where rollouts of two shares interleave on the stream.
Workers are started (the forkserver imports this module, off the event loop) while this process
builds the index. Each gets its share (its rollouts' index entries, its units) as one MessagePack
message and sends back its rows the same way: pickling the index's Structs one object at a time
cost about a second of CPU at 100k calls. Memory per worker stays bounded by the units in flight
(`budget` calls per batch), not by the run. A small run (or `workers=0`, or a store without a
URL to reconnect to) is replayed in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import types
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import msgspec

from services.common.eventstore import EventStore
from services.tools.compare import Comparison, compare
from services.tools.report import SchemeAccumulator, SchemeReport, UnitRows, unit_rows
from services.tools.schemes import base_config, schemes
from services.tools.source import (
    CALL_BUDGET,
    RolloutEntry,
    RunIndex,
    Unit,
    UnitInput,
    call_counts,
    index_run,
    plan_units,
    stream_chunks,
    unit_rollouts,
)
from trainer.core import AdapterConfig

REPORT_VERSION = 1
MIN_PARALLEL_CALLS = 32_768
"""Below this many calls, starting worker processes costs more than it saves."""


class ReplayReport(msgspec.Struct, frozen=True, kw_only=True):
    """A replayed run: one report per scheme and, with several schemes, their comparison."""

    version: int
    run_id: str
    step: int | None
    schemes: list[SchemeReport]
    comparison: Comparison | None


def default_workers() -> int:
    """Worker processes for a large replay: one per CPU core, at most 8 (none on one core)."""
    cores = os.cpu_count() or 1
    return 0 if cores < 2 else min(8, cores)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a while (back on after, if it was on).

    A chunk's calls, token lists and samples form no cycles and are freed by reference counting
    as soon as each unit is done, but their millions of allocations would set off collections that
    walk every long-lived object of the process (the run's index among them): about a third of a
    100k-call replay's time. Off for a worker's whole share (its reads' messages too) and while the
    index is built (its entries grow until the end): about 4% of a worker's CPU time at 100k calls.
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
            results.append(unit_rows(item.unit.step, rollouts, configs, skipped))
    return results


class Share(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker needs to read and replay its share (sent as one MessagePack message)."""

    run_id: str
    rollouts: list[RolloutEntry]
    units: list[Unit]
    configs: list[AdapterConfig]
    budget: int


_share_decoder = msgspec.msgpack.Decoder(Share)
_results_decoder = msgspec.msgpack.Decoder(list[list[UnitRows]])


def replay_share(url: str, stream: str, share: bytes) -> bytes:
    """Read and replay one share (worker side): per unit, one `UnitRows` per config, as MessagePack."""
    with _collector_paused():
        return msgspec.msgpack.encode(asyncio.run(_replay_share(url, stream, _share_decoder.decode(share))))


async def _replay_share(url: str, stream: str, share: Share) -> list[list[UnitRows]]:
    store = await EventStore.connect(url, stream=stream, ensure=False, name="rollwire-replay")
    try:
        rollouts = {entry.rollout_id: entry for entry in share.rollouts}
        index = RunIndex(run_id=share.run_id, rollouts=rollouts, recorded_adapter=None, has_steps=False)
        results: list[list[UnitRows]] = []
        async for chunk in stream_chunks(store, index, share.units, budget=share.budget):
            results.extend(replay_chunk(chunk, share.configs))
        return results
    finally:
        await store.close()


def _warm() -> None:
    """A worker's first task: nothing, so that it starts and imports while the index is built."""


def split_units(units: list[Unit], shares: int) -> list[list[Unit]]:
    """The units (in run order) cut into at most `shares` runs of consecutive units of about equal calls."""
    total = sum(unit.calls for unit in units)
    cuts: list[list[Unit]] = [[]]
    done = 0
    for unit in units:
        if cuts[-1] and len(cuts) < shares and done >= total * len(cuts) / shares:
            cuts.append([])
        cuts[-1].append(unit)
        done += unit.calls
    return [cut for cut in cuts if cut]


async def _replay_units(
    store: EventStore,
    index: RunIndex,
    accumulators: list[SchemeAccumulator],
    step: int | None,
    pool: _Pool | None,
    budget: int | None,
) -> None:
    units = plan_units(index, step)
    order = {rid: entry.order for rid, entry in index.rollouts.items()}
    configs = [acc.config for acc in accumulators]

    def collect(results: list[list[UnitRows]]) -> None:
        for per_scheme in results:
            for acc, rows in zip(accumulators, per_scheme, strict=True):
                acc.add_rows(rows, order)

    if pool is None:
        async for chunk in stream_chunks(store, index, units, budget=budget or CALL_BUDGET):
            collect(replay_chunk(chunk, configs))
        return
    tasks = []
    for units_share in split_units(units, pool.size):
        share = Share(
            run_id=index.run_id,
            rollouts=[index.rollouts[rid] for unit in units_share for rid in unit.rollout_ids],
            units=units_share,
            configs=configs,
            budget=budget or CALL_BUDGET,
        )
        encoded = msgspec.msgpack.encode(share)
        tasks.append(asyncio.ensure_future(pool.run(replay_share, store.url, store.stream, encoded)))
    try:
        for done in asyncio.as_completed(tasks):
            collect(_results_decoder.decode(await done))
    finally:  # a failed or cancelled replay leaves no task behind (the pool's shutdown ends the work)
        for task in tasks:
            task.cancel()


class _Pool:
    """Replay worker processes, started off the event loop (the forkserver imports this module first)."""

    def __init__(self, executor: ProcessPoolExecutor, size: int) -> None:
        self.executor, self.size = executor, size
        self.started = asyncio.get_running_loop().run_in_executor(None, self._start)

    def _start(self) -> None:
        for _ in range(self.size):
            self.executor.submit(_warm)

    async def run(self, fn: Callable[..., bytes], *args: Any) -> bytes:
        """`fn(*args)` in a worker, once the workers are up."""
        await self.started
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def _main_imports() -> list[str]:
    """The modules the main script took names from (`rollwire`'s CLI, a user's script).

    multiprocessing runs the main script again in every worker it starts; preloaded once in the
    forkserver, its imports are already there when it does (each worker would import them anew).
    """
    main = sys.modules.get("__main__")
    names: set[str] = set()
    for value in vars(main).values() if main is not None else ():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name in sys.modules and name not in ("__main__", "__mp_main__"):
            names.add(name)
    return sorted(names)


@contextlib.asynccontextmanager
async def _workers(store: EventStore, calls: int, workers: int | None) -> AsyncIterator[_Pool | None]:
    """A pool of replay workers (starting) for a run of `calls` calls (None: replay in this process)."""
    if workers is None:
        workers = default_workers() if calls >= MIN_PARALLEL_CALLS else 0
    if workers <= 0 or not store.url:
        yield None
        return
    # forkserver: a worker must not inherit this process's event loop and NATS connection; forked
    # from a server that imported this module once, workers start in milliseconds, not seconds.
    context = get_context("forkserver")
    context.set_forkserver_preload([__name__, *_main_imports()])
    executor = ProcessPoolExecutor(workers, mp_context=context)
    pool = _Pool(executor, workers)
    try:
        yield pool
    finally:
        with contextlib.suppress(Exception):
            await pool.started
        executor.shutdown(wait=True, cancel_futures=True)


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
    counts = await call_counts(store, run_id)  # before the index: the workers start while it is read
    async with _workers(store, sum(counts.values()), workers) as pool:
        with _collector_paused():
            index = await index_run(store, run_id, nats_url=nats_url, counts=counts)
        base = base_config(index.recorded_adapter, options or {})
        selection = {"agents": base.agents, "models": base.models}
        compared = [
            msgspec.structs.replace(
                s, config=AdapterConfig.from_mapping({**msgspec.structs.asdict(s.config), **selection})
            )
            for s in schemes(base, compare_specs)
        ]
        accumulators = [SchemeAccumulator(scheme) for scheme in compared]
        await _replay_units(store, index, accumulators, step, pool, budget)
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
