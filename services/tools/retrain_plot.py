"""`rollwire retrain --compare A B`: re-trained curves side by side with the original run's, in one PNG.

Each of A, B, ... is a re-train's output directory (`metrics.csv` and `retrain.json`). One panel
per metric (loss, KL to the behaviour policy, entropy, clip fraction, grad norm, and validation
reward when any directory has it); each re-train is a solid line, and each original run they come
from is a dashed black line beside them, read from the run directory `retrain.json` names (a live
run's `approx_kl` is its KL to the behaviour policy, the same quantity).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from services.tools.plot import PlotUnavailable
from services.tools.retrain import RETRAIN_FILE
from services.tools.source import ReplayError
from trainer.metrics import MetricsLog

PANELS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("approx_kl", "KL to the behaviour policy"),
    ("entropy", "entropy"),
    ("clip_fraction", "clip fraction"),
    ("grad_norm", "grad norm"),
    ("val/reward", "validation reward"),
)


class Curves:
    """A directory's metrics, labelled: a re-train's or the original run's."""

    def __init__(self, label: str, metrics: Path) -> None:
        self.label = label
        self.log = MetricsLog.read(metrics)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one column."""
        return self.log.series(key)


def load_curves(directories: Sequence[Path]) -> tuple[list[Curves], list[Curves]]:
    """The re-trains' curves and their original runs' (each run once), from the directories' files.

    Raises `ReplayError` naming a directory that is not a re-train's output.
    """
    retrained: list[Curves] = []
    originals: dict[str, Curves] = {}
    for directory in map(Path, directories):
        record_path, metrics = directory / RETRAIN_FILE, directory / "metrics.csv"
        if not record_path.is_file() or not metrics.is_file():
            raise ReplayError(f"{directory} is not a re-train's output (no {RETRAIN_FILE} or metrics.csv)")
        record = json.loads(record_path.read_text())
        retrained.append(Curves(f"{record['scheme']} (re-trained)", metrics))
        run_metrics = Path(record["run_dir"]) / "metrics.csv"
        if record["run_dir"] not in originals and run_metrics.is_file():
            originals[record["run_dir"]] = Curves(f"{record['run_id']} (original)", run_metrics)
    return retrained, list(originals.values())


def plot_compare(directories: Sequence[Path], out: Path) -> Path:
    """Draw the re-trains in `directories` and their original runs into `out` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise PlotUnavailable("--compare needs matplotlib: pip install matplotlib") from None
    retrained, originals = load_curves(directories)
    panels = [(key, title) for key, title in PANELS if any(c.series(key)[0] for c in [*retrained, *originals])]
    columns = min(3, max(1, len(panels)))
    rows = (len(panels) + columns - 1) // columns or 1
    fig, axes = plt.subplots(rows, columns, figsize=(5.0 * columns, 3.6 * rows), squeeze=False)
    for axis, (key, title) in zip(axes.flat, panels, strict=False):
        for curves in originals:
            steps, values = curves.series(key)
            axis.plot(steps, values, "k--", marker="x", markersize=4, label=curves.label)
        for curves in retrained:
            steps, values = curves.series(key)
            axis.plot(steps, values, marker="o", markersize=3, label=curves.label)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    if panels:
        axes.flat[0].legend(fontsize=8)
    fig.suptitle("re-trained from the log, beside the original run", fontsize=13)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
