"""The live view of a training run: a progress bar and one line per step (rich)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

DEFAULT_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward_mean", "reward", "{:.2f}"),
    ("val/reward", "val/reward", "{:.2f}"),
    ("samples_per_rollout", "samples/rollout", "{:.2f}"),
    ("merge_ratio", "calls/sample", "{:.2f}"),
    ("entropy", "entropy", "{:.2f}"),
    ("clip_fraction", "clipped", "{:.3f}"),
    ("time_step_s", "step", "{:.1f}s"),
)


def format_row(row: dict[str, Any], fields: Sequence[tuple[str, str, str]]) -> str:
    """One step as `step 3  reward 0.41  ...` (missing values shown as `-`)."""
    parts = [f"step {row.get('step')}"]
    for key, label, fmt in fields:
        if key not in row and key.startswith("val/"):
            continue  # a step without a validation pass
        value = row.get(key)
        parts.append(f"{label} {fmt.format(value) if isinstance(value, int | float) else '-'}")
    return "  ".join(parts)


class StepDisplay:
    """A rich progress bar over the run's steps that prints each finished step's figures above it."""

    def __init__(
        self,
        total_steps: int,
        *,
        first_step: int = 1,
        fields: Sequence[tuple[str, str, str]] = DEFAULT_FIELDS,
        console: Console | None = None,
    ) -> None:
        self.console = console or Console()
        self.fields = fields
        self.progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task("", total=total_steps, completed=first_step - 1)

    def __enter__(self) -> StepDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def step(self, row: dict[str, Any]) -> None:
        """Show a finished step."""
        line = format_row(row, self.fields)
        self.progress.console.print(line, highlight=False, soft_wrap=True)
        reward = row.get("reward_mean")
        description = f"reward {reward:.2f}" if isinstance(reward, int | float) else ""
        self.progress.update(self.task, advance=1, description=description)
