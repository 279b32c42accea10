"""The metrics table: fixed columns first, agent columns added when they appear, resumable, plotted."""

from __future__ import annotations

import csv
from pathlib import Path

from trainer.metrics import COLUMNS, MetricsLog, plot_curves


def test_csv_widens_for_new_columns_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    log = MetricsLog(path, tmp_path / "tb")
    log.add({"step": 1, "reward_mean": 0.25, "loss": 0.5})
    log.add({"step": 2, "reward_mean": 0.5, "agent_tool_used": 0.75})
    log.add({"step": 3, "reward_mean": 0.75, "agent_tool_used": 1.0})
    log.close()
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0])[: len(COLUMNS)] == list(COLUMNS) and list(rows[0])[-1] == "agent_tool_used"
    assert rows[0]["agent_tool_used"] == "" and rows[1]["agent_tool_used"] == "0.75"
    assert any((tmp_path / "tb").iterdir()) == log.tensorboard_enabled

    resumed = MetricsLog(path, resume_after=2)
    assert resumed.series("reward_mean") == ([1, 2], [0.25, 0.5])
    resumed.add({"step": 3, "reward_mean": 0.9})
    assert resumed.series("reward_mean") == ([1, 2, 3], [0.25, 0.5, 0.9])
    png = plot_curves(resumed, tmp_path / "curve.png", keys=("reward_mean", "agent_tool_used"), ylim=(0, 1))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
