"""A past run's trained steps read back one at a time: each step's rollouts as the trainer replayed them.

`rollwire retrain` needs every recorded step's rollouts, in step order, and never more than one
step in memory. It reads the run as `rollwire replay` does (`services.tools.source`): the index
(pass 1: every rollout's few small events, its step and its call count) and then, per step, one
read of that step's `model_request` events from its first rollout on, until its last call
(`stream_chunks` over the step's units), decoded by `unit_rollouts` with the adapter's selection,
stale calls dropped as the trainer dropped them. The step's rollouts are yielded and forgotten
before the next step is read, so the calls held are one step's; `peak_calls` records the most
held at once (a test and the benchmark check it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from services.common.eventstore import EventStore
from services.tools.source import CALL_BUDGET, ReplayError, RunIndex, plan_units, stream_chunks, unit_rollouts
from trainer.core import RolloutCalls, Selection


class StepReader:
    """Yields `(step, rollouts)` for the run's recorded steps, one step in memory at a time."""

    def __init__(self, store: EventStore, index: RunIndex, select: Selection | None = None) -> None:
        self.store = store
        self.index = index
        self.select = select
        self.steps_read = 0
        self.held_calls = 0
        """Calls of the step being read or handed out (the memory the reader holds)."""
        self.peak_calls = 0
        self.skipped: dict[str, str] = {}

    def steps(self, from_step: int = 0, count: int | None = None) -> list[int]:
        """The recorded steps from `from_step` on (at most `count`); raises `ReplayError` when there is none."""
        if not self.index.has_steps:
            raise ReplayError(
                f"run {self.index.run_id!r} has no trainer step records; only a run trained by `rollwire train` "
                "can be re-trained"
            )
        chosen = [s for s in self.index.steps if s >= from_step]
        if count is not None:
            chosen = chosen[:count]
        if not chosen:
            steps = self.index.steps
            raise ReplayError(
                f"run {self.index.run_id!r} has no trained step from {from_step} on; "
                f"its steps are {steps[0]}..{steps[-1]}"
                if steps
                else f"run {self.index.run_id!r} has no trained rollouts"
            )
        return chosen

    async def read(self, steps: Sequence[int]) -> AsyncIterator[tuple[int, list[RolloutCalls]]]:
        """Each step's trainable rollouts in run order (the order the trainer built its batch in)."""
        for step in steps:
            rollouts = await self.step(step)
            self.steps_read += 1
            yield step, rollouts
            self.held_calls = 0

    async def step(self, step: int) -> list[RolloutCalls]:
        """One step's rollouts, read from the stream (only this step's calls are kept)."""
        units = plan_units(self.index, step)
        self.held_calls = 0
        rollouts: list[RolloutCalls] = []
        async for chunk in stream_chunks(self.store, self.index, units, budget=CALL_BUDGET):
            for item in chunk:
                self.held_calls += item.unit.calls
                self.peak_calls = max(self.peak_calls, self.held_calls)
                found, skipped = unit_rollouts(item, self.select)
                rollouts.extend(found)
                self.skipped.update(skipped)
        order = self.index.rollouts
        rollouts.sort(key=lambda r: order[r.rollout_id].order)
        return rollouts
