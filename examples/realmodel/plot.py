"""Plot realmodel runs against wall time: held-out and training reward per minute, runs side by side.

    python examples/realmodel/plot.py runs/realmodel/metrics.csv:"full weights" \
        runs/realmodel-lora/metrics.csv:LoRA --out examples/realmodel/measured_curve.png

Each argument is a run's `metrics.csv`, optionally with `:label`. The x axis is minutes since the
run started (`elapsed_s`; step 0, the held-out pass on the starting weights, is minute 0), so runs
whose steps take different times compare as a user sees them: reward per minute of the laptop.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the file-only backend

from trainer.metrics import MetricsLog


def series(path: Path, key: str) -> tuple[list[float], list[float]]:
    """(minutes, values) of `key` in a run's metrics.csv, skipping steps without it."""
    seconds, values = MetricsLog.read(path).against(key, "elapsed_s")
    return [s / 60.0 for s in seconds], values


def main(argv: list[str] | None = None) -> None:
    """Write the plot of the runs given on the command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="metrics.csv[:label]")
    parser.add_argument("--out", type=Path, default=Path("realmodel_curve.png"))
    parser.add_argument("--title", default="SmolLM2-135M-Instruct on 2 CPU cores")
    args = parser.parse_args(argv)
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for index, spec in enumerate(args.runs):
        path, _, label = spec.partition(":")
        color = f"C{index}"
        label = label or Path(path).parent.name
        held_x, held_y = series(Path(path), "val/reward")
        axis.plot(held_x, held_y, "o-", color=color, linewidth=2, label=f"{label}: held-out (greedy)")
        train_x, train_y = series(Path(path), "reward_mean")
        axis.plot(train_x, train_y, ".:", color=color, alpha=0.6, label=f"{label}: training (T=0.7)")
    axis.axvline(30, color="grey", linestyle="--", linewidth=1)
    axis.set_xlabel("minutes since the run started")
    axis.set_ylabel("reward")
    axis.set_ylim(-0.02, 1.02)
    axis.set_title(args.title)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
