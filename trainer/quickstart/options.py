"""What `rollwire quickstart` can change, and its defaults: one definition, read by the command line
(without importing the run, and torch with it, before a command runs) and by the run itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HELDOUT_TASKS = 64  # drawn with another seed; each runs twice, sampled as in training, before step 1 and after the last


@dataclass
class QuickstartOptions:
    """What `rollwire quickstart` can change (the defaults are the README's run)."""

    steps: int = 30
    seed: int = 0
    data_dir: Path = Path(".rollwire")
    out: Path = Path("runs")
    mode: str = "sync"
    tasks_per_step: int = 8
    rollouts_per_task: int = 4
    lr: float = 3e-4
    heldout_tasks: int = HELDOUT_TASKS  # 0: no held-out pass (before/after is then the training reward)
    cache_dir: Path | None = None
    model_dir: Path | None = None
    fork_server: bool = True
    run_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
