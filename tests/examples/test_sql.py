"""The SQL example: generated databases, the execution-match rule, and one real step that trains the
writer and the rewriter but never the checker."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from example_run import example_config, run_one_step

from examples.sql.build import build
from examples.sql.database import QueryError, execute
from examples.sql.reward import execution_match
from services.common.eventstore import EventStore
from services.tools.replay import replay_run
from trainer.clients import ServiceUrls


def test_built_questions_have_gold_queries_that_answer_them(tmp_path: Path) -> None:
    report = build(tmp_path, databases=3, per_database=6, seed=2)
    tasks = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert report["tasks"] == len(tasks) >= 12
    for task in tasks:
        assert execute(task["db"], task["gold_sql"])  # non-empty
        assert "CREATE TABLE employees" in task["schema"]


def test_execution_is_read_only_and_bounded(tmp_path: Path) -> None:
    build(tmp_path, databases=1, per_database=1)
    db = str(tmp_path / "dbs" / "db-0.sqlite")
    with pytest.raises(QueryError):
        execute(db, "DELETE FROM employees")
    with pytest.raises(QueryError):
        execute(db, "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT COUNT(*) FROM n")
    assert len(execute(db, "SELECT * FROM employees, employees AS b")) == 200  # rows bounded


def test_execution_match_by_hand(tmp_path: Path) -> None:
    db = tmp_path / "hand.sqlite"
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE t (name TEXT, n INTEGER); INSERT INTO t VALUES ('b', 2), ('a', 1), ('c', 2);")
    con.commit()
    con.close()
    gold = "SELECT name FROM t WHERE n = 2"
    assert execution_match(str(db), "SELECT name FROM t WHERE n > 1", gold) == 1.0  # other SQL, same rows
    assert execution_match(str(db), "SELECT name FROM t WHERE n = 2 ORDER BY name DESC", gold) == 1.0  # as a set
    assert execution_match(str(db), "SELECT name FROM t", gold) == 0.0
    ordered = "SELECT name FROM t ORDER BY name"
    assert execution_match(str(db), "SELECT name FROM t ORDER BY name DESC", ordered) == 0.0  # order matters
    assert execution_match(str(db), "SELECT AVG(n) * 1.0 FROM t", "SELECT 5.0 / 3") == 1.0  # floats to 1e-6
    assert execution_match(str(db), "SELEC name", gold) == 0.0


async def _replays(nats_url: str, run_id: str) -> tuple[int, int]:
    """Calls in the samples of step 1 as trained, and with every agent selected."""
    store = await EventStore.connect(nats_url)
    try:
        trained = await replay_run(store, run_id, step=1)
        every = await replay_run(store, run_id, step=1, options={"agents": ["writer", "checker", "rewriter"]})
    finally:
        await store.close()
    return (sum(row.calls for row in trained.schemes[0].samples), sum(row.calls for row in every.schemes[0].samples))


@pytest.mark.slow
def test_one_training_step_trains_writer_and_rewriter_never_the_checker(
    tmp_path: Path, example_model: Path, example_stack: ServiceUrls
) -> None:
    build(tmp_path / "data", databases=2, per_database=4, seed=0)
    tasks = {json.loads(line)["question"]: json.loads(line) for line in (tmp_path / "data/tasks.jsonl").open()}
    config = example_config("sql", tmp_path, tmp_path / "data/tasks.jsonl", example_model)
    record = run_one_step(config, example_stack)

    assert record.rows[0]["rollouts"] == 4 and record.rows[0]["rollouts_failed"] == 0
    by_role: dict[str, list[str]] = {}
    for call in record.calls:
        by_role.setdefault(str(call.agent), []).append(call.call_id)
    assert set(by_role) >= {"writer", "checker"} and set(by_role) <= {"writer", "checker", "rewriter"}
    assert len(by_role["writer"]) == len(by_role["checker"]) == 4
    trained = [json.loads(line) for line in (Path(config.run_dir) / "samples" / "step-1.jsonl").open()]
    trained_calls = sum(row["calls"] for row in trained)
    assert trained_calls == len(by_role["writer"]) + len(by_role.get("rewriter", []))  # never the checker's
    # `rollwire replay --agents`: the same events re-analysed under another selection
    as_trained, everyone = asyncio.run(_replays(example_stack.nats_url, config.run.name))
    assert as_trained == trained_calls and everyone == len(record.calls)
    evaluations = record.payloads("evaluation")
    for rollout_id, reward in record.rewards_by_rollout().items():
        first = next(c for c in record.calls if c.rollout_id == rollout_id)
        question = first.request["messages"][1]["content"].split("Question: ")[1]
        task = tasks[question]
        sql = evaluations[rollout_id]["result"].get("sql")
        assert reward == (execution_match(task["db"], sql, task["gold_sql"]) if isinstance(sql, str) else 0.0)
