"""The SQL agent: three roles, each its own agent on the same endpoint, in one harness.

    python examples/sql/agent.py '{"db": "...", "question": "...", "schema": "..."}'

1. **writer** writes a query for the question, given the schema;
2. **checker** sees the question, the query and what the query returned (or its error) and says
   `CORRECT` or `INCORRECT`;
3. **rewriter**, when the checker said INCORRECT or the query failed, writes a corrected query.

Each role names itself with the `X-Rollwire-Agent` header (`default_headers` of its `openai`
client): Rollwire records the name on every call, so a run can train the writer and the rewriter
and keep the checker's calls as context only (selective optimization). Nothing else in the
harness knows about training. The final query goes to `result.json` for the evaluator.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from openai import OpenAI

from examples.sql.database import QueryError, execute
from examples.toolloop import read_input

ROLES = ("writer", "checker", "rewriter")
MAX_TOKENS = 80
WRITER_PROMPT = "Write one SQLite query that answers the question. Reply with the SQL only."
CHECKER_PROMPT = "Check whether the SQL query answers the question. Reply CORRECT or INCORRECT."
REWRITER_PROMPT = "The SQL query is wrong. Write a corrected SQLite query. Reply with the SQL only."
_FENCE = re.compile(r"```(?:sql)?\s*(.*?)```", re.S | re.I)


def agent(role: str) -> OpenAI:
    """An `openai` client configured by the environment, naming `role` on every call."""
    return OpenAI(max_retries=3, timeout=120.0, default_headers={"X-Rollwire-Agent": role})


def ask(client: OpenAI, system: str, user: str) -> str:
    """One chat call; the reply's text."""
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=MAX_TOKENS, temperature=1.0,
    )  # fmt: skip
    return reply.choices[0].message.content or ""


def extract_sql(text: str) -> str:
    """The query in a reply: a fenced block if there is one, else the whole text."""
    fenced = _FENCE.search(text)
    return (fenced.group(1) if fenced else text).strip()


def observe(db: str, sql: str) -> str:
    """What running the query shows the checker: the first rows, or the error."""
    try:
        rows = execute(db, sql)
    except QueryError as exc:
        return f"error: {exc}"
    return repr(rows[:5])[:400]


def main() -> None:
    """Write, check, maybe rewrite; leave the final query in `result.json`."""
    task = read_input()
    context = f"Schema:\n{task['schema']}\n\nQuestion: {task['question']}"
    sql = extract_sql(ask(agent("writer"), WRITER_PROMPT, context))
    seen = observe(task["db"], sql)
    verdict = ask(agent("checker"), CHECKER_PROMPT, f"{context}\n\nSQL: {sql}\nResult: {seen}")
    rewritten = seen.startswith("error:") or "INCORRECT" in verdict.upper() or "CORRECT" not in verdict.upper()
    if rewritten:
        sql = extract_sql(ask(agent("rewriter"), REWRITER_PROMPT, f"{context}\n\nSQL: {sql}\nResult: {seen}"))
    Path("result.json").write_text(json.dumps({"sql": sql, "verdict": verdict[:200], "rewritten": rewritten}))
    print(f"sql={sql!r} verdict={verdict!r} rewritten={rewritten}")


if __name__ == "__main__":
    main()
