"""Build the calc example's data: arithmetic word problems, their gold answers, warm-start conversations.

Each problem comes from a template that mixes several operations and names numbers the answer does
not use (distractors: an age, a year, a price of something else). Its answer is computed twice,
exactly (`Fraction`): once by the template's own arithmetic and once by evaluating the gold
expression with the calculator's AST walker; a problem whose two values differ is a bug and stops
the build.

    python -m examples.calc.build --out examples/calc/data [--count 2000] [--seed 0]

writes `tasks.jsonl` (one rollout input per line: `id`, `question`, `answer`, `expression`) and
`transcripts.jsonl` (gold conversations for `examples.warmstart`). A user's own problems work the
same way: a JSONL file with `question` and a numeric `answer` per line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from examples.calc.agent import SYSTEM_PROMPT
from examples.calc.calculator import TOOL, evaluate, format_number

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ivan", "Sara", "Kofi", "Yuki", "Ravi")
Problem = tuple[str, str, Fraction]  # question, gold expression, exact answer


def _shopping(r: random.Random) -> Problem:
    name, a, b, c, d, p, age = r.choice(NAMES), r.randint(2, 9), r.randint(3, 40), r.randint(2, 6), \
        r.randint(5, 60), r.choice((10, 15, 20, 25)), r.randint(9, 70)  # fmt: skip
    question = (
        f"{name}, who is {age} years old, buys {a} shirts at {b} dollars each and {c} hats at {d} dollars each. "
        f"The shop takes {p} percent off the total. How many dollars does {name} pay?"
    )
    return question, f"({a} * {b} + {c} * {d}) * (100 - {p}) / 100", Fraction(a * b + c * d) * (100 - p) / 100


def _speed(r: random.Random) -> Problem:
    a, b, c, d, fare = r.randint(60, 400), r.randint(1, 5), r.randint(60, 400), r.randint(1, 5), r.randint(10, 90)
    question = (
        f"A train runs {a} km in {b} hours, stops, then runs {c} km in {d} hours. A ticket costs {fare} dollars. "
        "What is its average speed in km per hour over the whole trip?"
    )
    return question, f"({a} + {c}) / ({b} + {d})", Fraction(a + c, b + d)


def _sharing(r: random.Random) -> Problem:
    name, a, b, c, year = r.choice(NAMES), r.randint(40, 300), r.randint(1, 30), r.randint(2, 9), r.randint(1990, 2024)
    question = (
        f"In {year}, {name} picked {a} apples, ate {b} of them and shared the rest equally among {c} friends. "
        "How many apples did each friend get?"
    )
    return question, f"({a} - {b}) / {c}", Fraction(a - b, c)


def _savings(r: random.Random) -> Problem:
    name, start, weekly, weeks, spent, height = r.choice(NAMES), r.randint(10, 500), r.randint(5, 80), \
        r.randint(2, 20), r.randint(1, 100), r.randint(120, 190)  # fmt: skip
    question = (
        f"{name} is {height} cm tall and has {start} dollars saved. {name} adds {weekly} dollars every week for "
        f"{weeks} weeks, then spends {spent} dollars on a game. How many dollars are left?"
    )
    return question, f"{start} + {weekly} * {weeks} - {spent}", Fraction(start + weekly * weeks - spent)


def _area(r: random.Random) -> Problem:
    a, b, c, price, door = r.randint(3, 30), r.randint(3, 30), r.randint(2, 12), r.randint(2, 15), r.randint(1, 4)
    question = (
        f"A room is {a} m long and {b} m wide, with {door} doors. A square rug of side {c} m covers part of the "
        f"floor. Varnish costs {price} dollars per square metre. How much does varnishing the uncovered floor cost?"
    )
    return question, f"({a} * {b} - {c} ** 2) * {price}", Fraction(a * b - c * c) * price


def _percent(r: random.Random) -> Problem:
    total, p, q, bus = r.randint(100, 2000), r.randint(5, 60), r.randint(5, 60), r.randint(2, 40)
    question = (
        f"A school has {total} students and {bus} buses. {p} percent of the students walk to school, and "
        f"{q} percent of the others cycle. How many students cycle?"
    )
    return question, f"{total} * (100 - {p}) / 100 * {q} / 100", Fraction(total) * (100 - p) / 100 * q / 100


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (_shopping, _speed, _sharing, _savings, _area, _percent)


def make_problem(r: random.Random, index: int) -> dict[str, Any]:
    """One task; the template's own value and the calculator's value of the gold expression must agree."""
    question, expression, value = r.choice(TEMPLATES)(r)
    if evaluate(expression) != value:
        raise AssertionError(f"template value {value} differs from {expression} = {evaluate(expression)}")
    return {"id": f"calc-{index}", "question": question, "answer": format_number(value), "expression": expression}


def transcript(task: dict[str, Any]) -> dict[str, Any]:
    """The gold conversation: one calculator call with the gold expression, then the answer line."""
    arguments = json.dumps({"expression": task["expression"]})
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": task["answer"]},
        {"role": "assistant", "content": f"### ANSWER: {task['answer']}"},
    ]
    return {"messages": messages, "tools": [TOOL]}


def build(out: Path, count: int, seed: int) -> dict[str, Any]:
    """Write `tasks.jsonl` and `transcripts.jsonl` into `out`; returns counts and the time taken."""
    start = time.monotonic()
    r = random.Random(seed)
    tasks = [make_problem(r, i) for i in range(count)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks), encoding="utf-8")
    (out / "transcripts.jsonl").write_text("".join(json.dumps(transcript(t)) + "\n" for t in tasks), encoding="utf-8")
    return {"tasks": len(tasks), "seconds": round(time.monotonic() - start, 3)}


def main(argv: list[str] | None = None) -> None:
    """CLI: build the data into `--out`."""
    parser = argparse.ArgumentParser(description="Build the calc example's tasks and warm-start conversations.")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = build(args.out, args.count, args.seed)
    print(f"wrote {report['tasks']} tasks to {args.out / 'tasks.jsonl'} in {report['seconds']}s")


if __name__ == "__main__":
    main()
