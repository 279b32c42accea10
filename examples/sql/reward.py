"""The SQL reward (execution match), and the evaluator that reports it.

Rule: the final query and the gold query both run on the task's database (read-only, bounded);
reward 1 when they return the same rows — in the same order when the gold query has `ORDER BY`,
as a multiset otherwise, numbers compared to 1e-6 — else 0 (a query that fails scores 0). This is
Spider's execution accuracy.

    python -m examples.sql.reward     (as the run's evaluator_command)
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.evaluate import evaluator_main
from examples.sql.database import QueryError, execute


def _canonical(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [tuple(round(v, 6) if isinstance(v, float) else v for v in row) for row in rows]


def execution_match(db: str, predicted: str, gold: str) -> float:
    """1.0 when `predicted` returns what `gold` returns on `db` (see the module docstring), else 0.0."""
    expected = _canonical(execute(db, gold))
    try:
        got = _canonical(execute(db, predicted))
    except QueryError:
        return 0.0
    if re.search(r"\border\s+by\b", gold, re.I):
        return 1.0 if got == expected else 0.0
    return 1.0 if Counter(got) == Counter(expected) else 0.0


def evaluate(task: dict[str, Any], result: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The reward of one rollout and the metrics the trainer averages per step."""
    sql = result.get("sql")
    reward = execution_match(task["db"], sql, task["gold_sql"]) if isinstance(sql, str) else 0.0
    try:
        runs = float(isinstance(sql, str) and execute(task["db"], sql) is not None)
    except QueryError:
        runs = 0.0
    return reward, {"executes": runs, "rewritten": float(bool(result.get("rewritten")))}


if __name__ == "__main__":
    evaluator_main(evaluate)
