"""The quickstart's before/after: a held-out pass on the starting weights and after the last step.

The training reward's first steps already include the first updates' effect (one update can double
the rate of tool use), so the quickstart measures its gain on held-out tasks instead: drawn with
another seed, run in `val` mode before step 1 and after the last step."""

from __future__ import annotations

from pathlib import Path

from trainer.dataset import load_jsonl
from trainer.metrics import MetricsLog
from trainer.quickstart.run import (
    HELDOUT_ROLLOUTS,
    QuickstartOptions,
    heldout_before_after,
    quickstart_config,
    write_datasets,
)


def test_the_config_runs_the_heldout_pass_at_the_start_and_after_the_last_step(tmp_path: Path) -> None:
    options = QuickstartOptions(steps=12, lr=1e-4)
    config = quickstart_config(options, "q", tmp_path, tmp_path / "tasks.jsonl", ["agent"], tmp_path / "held.jsonl")
    assert config.validation is not None
    assert config.validation.at_start and config.validation.every == 12
    assert config.validation.rollouts_per_task == HELDOUT_ROLLOUTS
    assert config.validation.path.endswith("held.jsonl")
    assert config.algorithm.lr == 1e-4
    assert quickstart_config(options, "q", tmp_path, tmp_path / "tasks.jsonl", ["agent"]).validation is None


def test_the_run_writes_heldout_tasks_that_are_not_training_tasks(tmp_path: Path) -> None:
    dataset, heldout = write_datasets(QuickstartOptions(seed=3, heldout_tasks=64), tmp_path / "run")
    assert heldout is not None
    training = {(task["task_id"], task["key"], task["value"]) for task in load_jsonl(dataset)}
    held = [(task["task_id"], task["key"], task["value"]) for task in load_jsonl(heldout)]
    assert len(held) == 64 and not training & set(held)  # drawn with their own seed, never trained on
    assert write_datasets(QuickstartOptions(seed=3, heldout_tasks=64), tmp_path / "again")[1].read_bytes() == (
        heldout.read_bytes()
    )  # the same every run of that seed
    assert write_datasets(QuickstartOptions(heldout_tasks=0), tmp_path / "none")[1] is None


def test_before_and_after_are_the_first_and_last_heldout_passes(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.csv")
    log.add({"step": 0, "weights_version": 0, "val/reward": 0.25})
    log.add({"step": 1, "reward_mean": 0.4})
    log.add({"step": 2, "reward_mean": 0.6, "val/reward": 0.625})
    assert heldout_before_after(log) == (0.25, 0.625)

    without_start = MetricsLog(tmp_path / "other.csv")
    without_start.add({"step": 1, "reward_mean": 0.4, "val/reward": 0.5})
    without_start.add({"step": 2, "reward_mean": 0.6, "val/reward": 0.625})
    assert heldout_before_after(without_start) is None  # no pass on the starting weights: no before
