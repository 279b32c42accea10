"""Replay a past run from its events under one or more schemes; no agent runs again.

    store = await EventStore.connect(url)
    report = await replay_run(store, "r42", compare=["rollout-mean", "seq-mean-token-mean"])

The run is read group by group (`services.replay.source`), every unit goes through the adapter
under each scheme (`services.replay.report`), and with two or more schemes the rollouts' loss
weights are compared (`services.replay.compare`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from services.eventstore import EventStore
from services.replay.compare import Comparison, compare
from services.replay.report import SchemeAccumulator, SchemeReport
from services.replay.schemes import base_config, schemes
from services.replay.source import CALL_BUDGET, index_run, plan_units, stream_units

REPORT_VERSION = 1


class ReplayReport(msgspec.Struct, frozen=True, kw_only=True):
    """A replayed run: one report per scheme and, with several schemes, their comparison."""

    version: int
    run_id: str
    step: int | None
    schemes: list[SchemeReport]
    comparison: Comparison | None


async def replay_run(
    store: EventStore,
    run_id: str,
    *,
    options: Mapping[str, Any] | None = None,
    compare_specs: Sequence[str] = (),
    step: int | None = None,
    nats_url: str = "",
    budget: int = CALL_BUDGET,
) -> ReplayReport:
    """Rebuild the run's samples under the base scheme and each `compare_specs` scheme.

    `options` are the command's scheme options (`merge`, `advantage`, `estimator`, `std`, `norm`;
    None = the run's recorded adapter config, else the adapter's default). `step` replays only the
    rollouts the trainer recorded in that step. Raises `RunNotFound`, `ReplayError` or the
    adapter's `AdapterConfigError` with a message for the user.
    """
    index = await index_run(store, run_id, nats_url=nats_url)
    base = base_config(index.recorded_adapter, options or {})
    chosen = schemes(base, compare_specs)
    units = plan_units(index, step)
    order = {rid: entry.order for rid, entry in index.rollouts.items()}
    accumulators = [SchemeAccumulator(scheme) for scheme in chosen]
    async for unit, rollouts in stream_units(store, index, units, budget=budget):
        for acc in accumulators:
            acc.add(unit.step, rollouts, order)
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
