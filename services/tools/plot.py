"""A PNG of how schemes weight the rollouts (matplotlib, Agg backend: no display needed).

Panels: each rollout's loss weight against its response tokens under every scheme (how a
normalization treats long and short rollouts); with two or more schemes, each scheme's weights
against the reference's (above the diagonal = the rollout gains), and the relative change of every
rollout, ranked (how much weight moves, and how many rollouts it moves between).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.tools.replay import ReplayReport


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def plot(report: ReplayReport, path: Path) -> Path:
    """Draw the report's schemes (and comparison) into `path` (PNG) and return it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib") from None

    comparison = report.comparison
    panels = 3 if comparison is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 5.0), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    scope = f"step {report.step}" if report.step is not None else "all rollouts"
    fig.suptitle(f"run {report.run_id} ({scope}): loss weight per rollout", fontsize=13)
    _weight_by_length(axes[0][0], report, colors)
    if comparison is not None:
        _against_reference(axes[0][1], comparison, colors)
        _ranked_changes(axes[0][2], comparison, colors)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finish(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _weight_by_length(ax: Any, report: ReplayReport, colors: list[str]) -> None:
    """Each scheme's loss weight per rollout against the rollout's response tokens."""
    import matplotlib.ticker

    markers = ["o", "s", "^", "D", "v", "P"]
    for i, scheme in enumerate(report.schemes):
        rows = [r for r in scheme.rollouts if r.response_tokens > 0]
        ax.scatter(
            [r.response_tokens for r in rows],
            [r.loss_weight for r in rows],
            s=18,
            alpha=0.7,
            marker=markers[i % len(markers)],
            color=colors[i % len(colors)],
            label=scheme.name,
        )
    lengths = [r.response_tokens for s in report.schemes for r in s.rollouts if r.response_tokens > 0]
    if lengths and max(lengths) >= 20 * min(lengths):  # lengths over decades: a log axis, plainly labelled
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    _finish(
        ax, "response tokens of the rollout", "loss weight of the rollout (share of its step)", "weight against length"
    )


def _against_reference(ax: Any, comparison: Any, colors: list[str]) -> None:
    """Each scheme's weight per rollout against the reference scheme's (above the diagonal: it gains)."""
    ref = comparison.reference
    reference = [s.loss_weight[ref] for s in comparison.rollouts]
    top = max([*reference, *[w for s in comparison.rollouts for w in s.loss_weight.values()]], default=1.0)
    ax.plot([0, top], [0, top], color="grey", linewidth=1, linestyle="--", label="unchanged")
    for i, name in enumerate(comparison.schemes[1:], start=1):
        ax.scatter(
            reference,
            [s.loss_weight[name] for s in comparison.rollouts],
            s=18,
            alpha=0.7,
            color=colors[i % len(colors)],
            label=name,
        )
    _finish(ax, f"loss weight under {ref}", "loss weight under the scheme", "above the line: the rollout gains")


def _ranked_changes(ax: Any, comparison: Any, colors: list[str]) -> None:
    """The relative change of each rollout's weight, ranked, per scheme."""
    for i, name in enumerate(comparison.schemes[1:], start=1):
        changes = sorted(100.0 * r for s in comparison.rollouts if (r := s.relative[name]) is not None)
        ax.plot(range(len(changes)), changes, color=colors[i % len(colors)], label=name, linewidth=2)
    ax.axhline(0.0, color="grey", linewidth=1)
    _finish(
        ax,
        "rollouts, ranked by change",
        f"change of loss weight vs {comparison.reference} (%)",
        "who gains and who loses",
    )
