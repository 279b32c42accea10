"""Build the SQL example's data: SQLite databases and questions with gold queries.

    python -m examples.sql.build --out examples/sql/data [--databases 20] [--questions 10] [--seed 0]

writes `dbs/db-N.sqlite` and `tasks.jsonl` (one rollout input per line: `id`, `db`, `schema`,
`question`, `gold_sql`). For Spider or BIRD, write the same fields from their `dev.json` and
database folders: the agent and the reward only need a database path, its schema text, the
question and the gold query.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from examples.sql.database import SCHEMA, make_database, questions


def build(out: Path, *, databases: int = 20, per_database: int = 10, seed: int = 0) -> dict[str, Any]:
    """Write the databases and the tasks into `out`; returns counts and seconds."""
    start = time.monotonic()
    rng = random.Random(seed)
    (out / "dbs").mkdir(parents=True, exist_ok=True)
    tasks: list[dict[str, Any]] = []
    for n in range(databases):
        db = (out / "dbs" / f"db-{n}.sqlite").resolve()
        make_database(db, rng)
        for item in questions(db, rng, per_database):
            tasks.append({"id": f"sql-{len(tasks)}", "db": str(db), "schema": SCHEMA, **item})
    (out / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks), encoding="utf-8")
    return {"tasks": len(tasks), "databases": databases, "seconds": round(time.monotonic() - start, 3)}


def main(argv: list[str] | None = None) -> None:
    """CLI: build the data into `--out`."""
    parser = argparse.ArgumentParser(description="Build the SQL example's databases and questions.")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--databases", type=int, default=20)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = build(args.out, databases=args.databases, per_database=args.questions, seed=args.seed)
    print(f"wrote {report['tasks']} tasks over {report['databases']} databases to {args.out} in {report['seconds']}s")


if __name__ == "__main__":
    main()
