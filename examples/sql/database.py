"""Generated SQLite databases, questions with gold queries, and the bounded execution both sides use.

Every database has one schema (departments, employees, projects) and its own random rows, so a
query cannot be memorised across databases. Each question comes from a template with its gold
query; a question whose gold query returns nothing, or whose answer would be a tie, is not kept.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, dept_id INTEGER REFERENCES departments(id),
                        salary INTEGER NOT NULL, hired_year INTEGER NOT NULL);
CREATE TABLE projects (id INTEGER PRIMARY KEY, name TEXT NOT NULL, dept_id INTEGER REFERENCES departments(id),
                       budget INTEGER NOT NULL);
""".strip()
DEPARTMENTS = ("Sales", "Research", "Support", "Finance", "Legal", "Design", "Logistics")
CITIES = ("Lyon", "Osaka", "Quito", "Tartu", "Accra", "Perth")
FIRST = ("Ana", "Ben", "Chen", "Dina", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jana", "Kai", "Lea", "Milo", "Nia")
LAST = ("Alves", "Brandt", "Costa", "Dahl", "Evans", "Fischer", "Garcia", "Holm", "Ito", "Jensen", "Kowal")
MAX_ROWS = 200
MAX_STEPS = 2_000_000  # SQLite VM instructions before a query is interrupted


class QueryError(RuntimeError):
    """The query could not run (syntax, unknown column, too slow, not read-only); the message says why."""


def make_database(path: Path, rng: random.Random) -> None:
    """A database file at `path` with the schema and random rows."""
    path.unlink(missing_ok=True)
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    departments = rng.sample(DEPARTMENTS, rng.randint(3, 5))
    for i, name in enumerate(departments, 1):
        db.execute("INSERT INTO departments VALUES (?, ?, ?)", (i, name, rng.choice(CITIES)))
    for i in range(1, rng.randint(12, 30)):
        db.execute("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", (
            i, f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.randint(1, len(departments)),
            rng.randrange(30_000, 120_000, 500), rng.randint(2005, 2024)))  # fmt: skip
    for i in range(1, rng.randint(5, 12)):
        budget = rng.randrange(10_000, 500_000, 1000)
        row = (i, f"Project {i}", rng.randint(1, len(departments)), budget)
        db.execute("INSERT INTO projects VALUES (?, ?, ?, ?)", row)
    db.commit()
    db.close()


def execute(db_path: Path | str, sql: str) -> list[tuple[Any, ...]]:
    """Run one read-only query with bounded time and rows; `QueryError` for anything that fails."""
    if len(sql) > 4000:
        raise QueryError("query longer than 4000 characters")
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise QueryError(f"cannot open the database: {exc}") from None
    steps = [0]

    def progress() -> int:
        steps[0] += 1000
        return 1 if steps[0] > MAX_STEPS else 0

    db.set_progress_handler(progress, 1000)
    try:
        return db.execute(sql).fetchmany(MAX_ROWS)
    except (sqlite3.Error, sqlite3.Warning, ValueError) as exc:
        raise QueryError(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__) from None
    finally:
        db.close()


def _one(db: Path, sql: str) -> Any:
    rows = execute(db, sql)
    return rows[0][0] if rows else None


def questions(db: Path, rng: random.Random, count: int) -> list[dict[str, str]]:
    """Up to `count` questions on `db`, each with its gold query (answers non-empty and unambiguous)."""
    depts = [r[0] for r in execute(db, "SELECT name FROM departments")]
    cities = [r[0] for r in execute(db, "SELECT DISTINCT city FROM departments")]
    join = "FROM employees e JOIN departments d ON e.dept_id = d.id"
    out: list[dict[str, str]] = []
    for _ in range(count * 3):
        dept, city, year = rng.choice(depts), rng.choice(cities), rng.randint(2008, 2022)
        q, sql = rng.choice((
            (f"How many employees work in the {dept} department?", f"SELECT COUNT(*) {join} WHERE d.name = '{dept}'"),
            (f"What is the highest salary in {city}?", f"SELECT MAX(e.salary) {join} WHERE d.city = '{city}'"),
            (f"List the names of employees hired after {year}, in alphabetical order.",
             f"SELECT name FROM employees WHERE hired_year > {year} ORDER BY name"),
            (f"What is the total budget of the projects of the {dept} department?",
             f"SELECT SUM(p.budget) FROM projects p JOIN departments d ON p.dept_id = d.id WHERE d.name = '{dept}'"),
            (f"What is the average salary in the {dept} department?",
             f"SELECT AVG(e.salary) {join} WHERE d.name = '{dept}'"),
            ("Which department has the most employees?",
             f"SELECT d.name {join} GROUP BY d.id ORDER BY COUNT(*) DESC LIMIT 1"),
        ))  # fmt: skip
        if _one(db, sql) is None or any(item["question"] == q for item in out):
            continue
        if q.startswith("Which department"):
            top = execute(db, f"SELECT COUNT(*) AS n {join} GROUP BY d.id ORDER BY n DESC LIMIT 2")
            if len(top) == 2 and top[0][0] == top[1][0]:
                continue  # a tie: more than one right answer
        out.append({"question": q, "gold_sql": sql})
        if len(out) == count:
            break
    return out
