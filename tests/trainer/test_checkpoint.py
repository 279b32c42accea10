"""Run directories: atomic checkpoints, the `latest` pointer, pruning, and named errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.checkpoint import CheckpointError, InFlightGroup, RunDir, TrainerState


def state(step: int, version: int) -> TrainerState:
    group = InFlightGroup(group_id="g", rollout_ids=["g-r0", "g-r1"], task_index=4, created_version=version)
    return TrainerState(run_id="r", step=step, weights_version=version, tasks_consumed=5, in_flight=[group])


def test_latest_checkpoint_round_trips_and_prune_keeps_protected(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").ensure()
    assert run.latest_checkpoint() is None
    for version in range(5):
        run.weights(version).mkdir()
    for step in (1, 2, 3):
        run.save_checkpoint(state(step, step), {"optimizer": {"x": torch.ones(2)}, "n": step})
    loaded, backend = run.latest_checkpoint()  # type: ignore[misc]
    assert loaded == state(3, 3)
    assert backend["n"] == 3 and torch.equal(backend["optimizer"]["x"], torch.ones(2))
    run.prune(keep_checkpoints=2, keep_weights=1, protect={0, 3})
    assert sorted(p.name for p in (run.root / "checkpoints").glob("step-*")) == ["step-2", "step-3"]
    assert sorted(p.name for p in (run.root / "weights").iterdir()) == ["v0", "v3", "v4"]


def test_unreadable_or_inconsistent_checkpoint_is_a_named_error(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").ensure()
    run.weights(1).mkdir()
    path = run.save_checkpoint(state(1, 1), {"n": 1})
    run.weights(1).rmdir()
    with pytest.raises(CheckpointError, match=r"names weights v1, but .*v1 is missing"):
        run.latest_checkpoint()
    run.weights(1).mkdir()
    (path / "trainer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        run.latest_checkpoint()
