"""The controller's view of runs and rollouts: pure folds over their events, rebuilt from the stream.

The controller keeps no state of its own. What it knows about a rollout (status, attempts, input)
is the contract's `fold` (`schemas.rollout`) of the rollout's `created`, `attempt` and `status`
events, and what it knows about a run (how its rollouts execute) is the contract's run fold (`schemas.run`).
Replaying the same events always gives the same view, so a restarted controller knows exactly what
the crashed one knew.
"""

from __future__ import annotations

import msgspec

from schemas.rollout import AttemptView, RolloutView
from schemas.run import RunView
from schemas.runs import RunSpec

NOT_LAUNCHED = "not launched: "
"""Prefix of the reason a backend gives for an execution that never started (its launcher stopped
first): the controller launches the attempt again instead of counting it as a failure."""


Attempt = AttemptView
"""One attempt of a rollout as the stream tells it (the contract's `AttemptView`)."""

Rollout = RolloutView
"""What the controller knows about one rollout: the contract's fold of its events (`schemas.rollout`)."""


def compact(rollout: RolloutView | None) -> RolloutView | None:
    """The state without a finished rollout's input, which the controller never needs again (memory)."""
    if rollout is not None and rollout.terminal and rollout.input is not None:
        return msgspec.structs.replace(rollout, input=None)
    return rollout


class RunSpecError(msgspec.Struct, frozen=True):
    """A run whose recorded config is not a valid RunSpec; the message says which field."""

    run_id: str
    message: str


def run_spec(view: RunView | None) -> RunSpec | RunSpecError | None:
    """How the run's rollouts execute, from the contract's run fold (`schemas.run`): its spec, the reason
    its stored spec is invalid (its rollouts fail with it), or None before its `RunStarted`."""
    if view is None or not view.started:
        return None
    if view.spec is not None:
        return view.spec
    return RunSpecError(view.run_id, view.spec_error or f"run {view.run_id} has an invalid spec")
