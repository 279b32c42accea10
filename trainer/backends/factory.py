"""The training backend a run's `[backend] kind` names: the one place that knows every backend.

Kept apart from the protocol (`trainer.backends.base`), which the backends import: the factory imports
them, so holding both in one module made an import circle.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainer.backends.base import TrainingBackend

if TYPE_CHECKING:
    from trainer.run.sections import TrainConfig


def build_backend(config: TrainConfig) -> TrainingBackend:
    """The backend `[backend] kind` names, loaded from `[model] path` (verl is imported only when chosen)."""
    settings = config.backend
    match settings.kind:
        case "cpu":
            from trainer.backends.cpu import CpuBackend

            return CpuBackend(Path(config.model.path), config.algorithm, seed=config.run.seed, settings=settings)
        case "verl":
            from trainer.backends.verl import VerlBackend

            return VerlBackend(Path(config.model.path), config.algorithm, seed=config.run.seed, settings=settings)
    raise ValueError(f"backend.kind: {settings.kind!r}; choose one of: cpu, verl")
