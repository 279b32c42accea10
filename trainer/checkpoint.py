"""A run directory: versioned weights, resumable checkpoints, and where everything else goes.

    runs/<run>/
      config.json            the run's settings (what `rollwire train` was given)
      weights/v0/ v1/ ...    one loadable model directory per weights version (safetensors)
      checkpoints/step-N/    trainer.json (step, weights version, tasks consumed, in-flight
                             rollouts) and state.pt (optimizer and RNG state)
      checkpoints/latest     the name of the newest complete checkpoint
      metrics.csv, tb/, reward_curve.png

A checkpoint directory is written under a temporary name and renamed, then `latest` is replaced
atomically, so a crash leaves the previous checkpoint intact. Resuming loads the weights version
the checkpoint names and continues with the next step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch

WEIGHTS_DIR = "weights"
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"


class InFlightGroup(msgspec.Struct, frozen=True, kw_only=True):
    """A task group declared but not trained on yet (async mode keeps some across steps)."""

    group_id: str
    rollout_ids: list[str]
    task_index: int
    created_version: int


class TrainerState(msgspec.Struct, frozen=True, kw_only=True):
    """Where a run stands after a step: enough to continue it exactly."""

    run_id: str
    step: int
    weights_version: int
    tasks_consumed: int
    in_flight: list[InFlightGroup] = []
    stream_seq: int = 0
    elapsed_s: float = 0.0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names the file and what to do."""


class RunDir:
    """Paths and atomic writes of one run directory (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def ensure(self) -> RunDir:
        """Create the directory tree."""
        (self.root / WEIGHTS_DIR).mkdir(parents=True, exist_ok=True)
        (self.root / CHECKPOINTS_DIR).mkdir(parents=True, exist_ok=True)
        return self

    def weights(self, version: int) -> Path:
        """The model directory of a weights version."""
        return self.root / WEIGHTS_DIR / f"v{version}"

    @property
    def metrics_csv(self) -> Path:
        """The per-step metrics table."""
        return self.root / "metrics.csv"

    @property
    def tensorboard(self) -> Path:
        """The TensorBoard log directory."""
        return self.root / "tb"

    def samples(self, step: int) -> Path:
        """What step `step` trained on: one JSON line per sample (sizes, advantage, token weight)."""
        return self.root / "samples" / f"step-{step}.jsonl"

    @property
    def reward_curve(self) -> Path:
        """The reward-per-step plot."""
        return self.root / "reward_curve.png"

    def save_checkpoint(self, state: TrainerState, backend_state: dict[str, Any]) -> Path:
        """Write a checkpoint for `state.step` and point `latest` at it."""
        directory = self.root / CHECKPOINTS_DIR
        final = directory / f"step-{state.step}"
        staging = directory / f".step-{state.step}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        (staging / "trainer.json").write_bytes(msgspec.json.encode(state))
        torch.save(backend_state, staging / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        pointer = directory / f".{LATEST}.partial"
        pointer.write_text(final.name)
        os.replace(pointer, directory / LATEST)
        return final

    def latest_checkpoint(self) -> tuple[TrainerState, dict[str, Any]] | None:
        """The newest checkpoint's state and backend state, or None when the run has none."""
        pointer = self.root / CHECKPOINTS_DIR / LATEST
        if not pointer.is_file():
            return None
        directory = self.root / CHECKPOINTS_DIR / pointer.read_text().strip()
        try:
            state = msgspec.json.decode((directory / "trainer.json").read_bytes(), type=TrainerState)
            backend_state = torch.load(directory / "state.pt", weights_only=True)
        except (OSError, msgspec.DecodeError, RuntimeError) as exc:
            raise CheckpointError(
                f"checkpoint {directory} cannot be read ({exc}); delete it and `{pointer}` to start over"
            ) from None
        if not self.weights(state.weights_version).is_dir():
            raise CheckpointError(
                f"checkpoint {directory} names weights v{state.weights_version}, but "
                f"{self.weights(state.weights_version)} is missing"
            )
        return state, backend_state

    def prune(self, keep_checkpoints: int, keep_weights: int, protect: set[int]) -> None:
        """Delete all but the newest checkpoints and weights versions (never those in `protect`)."""
        checkpoints = sorted(
            (p for p in (self.root / CHECKPOINTS_DIR).glob("step-*") if p.is_dir()),
            key=lambda p: int(p.name.removeprefix("step-")),
        )
        for old in checkpoints[:-keep_checkpoints] if keep_checkpoints > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        versions = sorted(
            int(p.name[1:]) for p in (self.root / WEIGHTS_DIR).glob("v*") if p.is_dir() and p.name[1:].isdigit()
        )
        for version in versions[:-keep_weights] if keep_weights > 0 else []:
            if version not in protect:
                shutil.rmtree(self.weights(version), ignore_errors=True)
