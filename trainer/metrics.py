"""Per-step metrics: a CSV table, TensorBoard scalars, other trackers (`trainer.loggers`), and a reward curve.

Every step is one row (`step` first, then the figures in a fixed order; agent-reported metrics
are added as `agent_<name>` columns when they first appear, and the file is rewritten with the
wider header). Rows of a resumed run are read back, so the CSV and the curve cover the whole run.
TensorBoard is optional: without the `tensorboard` package the scalars are only in the CSV.
Weights & Biases, MLflow and the Prometheus endpoint are sinks chosen in `[metrics]` of the train config.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.loggers import StepSink

Row = dict[str, float | int | str | None]

UPDATE_COLUMNS = (
    "loss",
    "entropy",
    "clip_fraction",
    "dual_clip_fraction",
    "ratio_mean",
    "approx_kl",
    "kl_ref",
    "grad_norm",
)
"""The `UpdateMetrics` fields a step row carries, under the same names."""

COLUMNS: tuple[str, ...] = (
    "step",
    "weights_version",
    "rollouts",
    "rollouts_failed",
    "rollouts_failed_scored",
    "rollouts_failed_dropped",
    "rollouts_infra_dropped",
    "groups",
    "groups_skipped",
    "reward_mean",
    "reward_std",
    "val/reward",
    "advantage_mean",
    "advantage_std",
    "advantage_abs_mean",
    "samples",
    "samples_per_rollout",
    "samples_per_rollout_max",
    "rollouts_single_sample",
    "merge_ratio",
    "calls",
    "calls_deduped",
    "calls_context",
    "calls_stale_dropped",
    "staleness_max",
    "tokens",
    "response_tokens",
    *UPDATE_COLUMNS,
    "time_wait_s",
    "time_replay_s",
    "time_drain_s",
    "time_update_s",
    "time_save_s",
    "time_reload_s",
    "time_step_s",
    "elapsed_s",
)


def _number(value: str) -> float | int | str | None:
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return value


class MetricsLog:
    """The run's metrics table and TensorBoard writer (see the module docstring)."""

    def __init__(
        self,
        csv_path: Path,
        tensorboard_dir: Path | None = None,
        *,
        resume_after: int | None = None,
        sinks: Sequence[StepSink] = (),
    ):
        self.csv_path = Path(csv_path)
        self.sinks = list(sinks)
        self.rows: list[Row] = []
        if resume_after is not None and self.csv_path.is_file():
            with self.csv_path.open(newline="") as handle:
                for raw in csv.DictReader(handle):
                    row = {k: _number(v) for k, v in raw.items()}
                    step = row.get("step")
                    if isinstance(step, int) and step <= resume_after:
                        self.rows.append(row)
        self._writer: Any = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._writer = None
            else:
                self._writer = SummaryWriter(str(tensorboard_dir))

    @property
    def tensorboard_enabled(self) -> bool:
        """Whether scalars also go to TensorBoard (the `tensorboard` package is installed)."""
        return self._writer is not None

    def columns(self) -> list[str]:
        """The header: the fixed columns, then any others in order of first appearance."""
        extra: list[str] = []
        for row in self.rows:
            extra += [k for k in row if k not in COLUMNS and k not in extra]
        return [*COLUMNS, *extra]

    def add(self, row: Mapping[str, Any]) -> None:
        """Record one step's row: append it, rewrite the CSV atomically, log the numbers to TensorBoard."""
        self.rows.append(dict(row))
        self._write_csv()
        if self._writer is not None:
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        for sink in self.sinks:
            sink.log(row)

    def _write_csv(self) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=self.columns(), extrasaction="ignore")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        staging = self.csv_path.with_name(f".{self.csv_path.name}.partial")
        staging.write_text(buffer.getvalue())
        os.replace(staging, self.csv_path)

    @classmethod
    def read(cls, csv_path: Path) -> MetricsLog:
        """A run's metrics table read back whole (for plots and reports; nothing is written)."""
        return cls(csv_path, resume_after=1 << 62)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one column, skipping steps where it is missing."""
        steps, values = self.against(key, "step")
        return [int(step) for step in steps], values

    def against(self, key: str, by: str) -> tuple[list[float], list[float]]:
        """(values of `by`, values of `key`) of the steps that have `key` (`by` missing counts as 0)."""
        xs: list[float] = []
        values: list[float] = []
        for row in self.rows:
            value = row.get(key)
            if isinstance(value, int | float):
                x = row.get(by)
                xs.append(float(x) if isinstance(x, int | float) else 0.0)
                values.append(float(value))
        return xs, values

    def close(self) -> None:
        """Close the TensorBoard writer and the other sinks."""
        from trainer.loggers import close_all

        if self._writer is not None:
            self._writer.close()
        close_all(self.sinks)
        self.sinks = []


def plot_curves(
    log: MetricsLog,
    out: Path,
    keys: Sequence[str] = ("reward_mean",),
    title: str = "",
    ylim: tuple[float, float] | None = None,
) -> Path:
    """A PNG of the given columns per step (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4), dpi=120)
    for key in keys:
        steps, values = log.series(key)
        if steps:
            axis.plot(steps, values, marker="o", markersize=3, label=key)
    axis.set_xlabel("step")
    if ylim is not None:
        axis.set_ylim(*ylim)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    if title:
        axis.set_title(title)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
    return out
