"""Build the realmodel example's data: small arithmetic questions with exact integer answers.

Half the questions are `Which number is smaller, A or B?` (A, B from 10 to 99), half `What is
A + B?` (A from 2 to 50, B from 2 to 9). SmolLM2-135M-Instruct, asked through the agent at
temperature 0.7, gets about a quarter of them right, and its 8 answers to one question usually
disagree (it knows many of these sums and comparisons, but often rambles, or ends on the wrong
number): the groups carry signal. The calculator is offered; the untrained model never calls it.
The training and held-out sets are drawn with different seeds and share no question.

    python -m examples.realmodel.build [--out examples/realmodel/data] [--count 2000] [--heldout 80]

writes `tasks.jsonl` and `heldout.jsonl` (one rollout input per line: `id`, `question`, `answer`; the
held-out ones also `temperature: 0`, so the agent answers them greedily).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def question(r: random.Random) -> tuple[str, int]:
    """One question and its exact answer."""
    if r.random() < 0.5:
        a, b = r.sample(range(10, 100), 2)
        return f"Which number is smaller, {a} or {b}?", min(a, b)
    a, b = r.randint(2, 50), r.randint(2, 9)
    return f"What is {a} + {b}?", a + b


def draw(r: random.Random, count: int, avoid: set[str]) -> list[dict[str, Any]]:
    """`count` distinct questions not in `avoid`."""
    tasks: list[dict[str, Any]] = []
    seen = set(avoid)
    while len(tasks) < count:
        text, answer = question(r)
        if text in seen:
            continue
        seen.add(text)
        tasks.append({"id": f"q{len(tasks)}", "question": text, "answer": answer})
    return tasks


def build(out: Path, count: int = 2000, heldout: int = 80, seed: int = 0) -> dict[str, int]:
    """Write `tasks.jsonl` and `heldout.jsonl` under `out`; returns their sizes."""
    out.mkdir(parents=True, exist_ok=True)
    held = draw(random.Random(seed + 1_000_003), heldout, set())
    train = draw(random.Random(seed), count, {t["question"] for t in held})
    held = [{**row, "temperature": 0.0} for row in held]  # greedy: the held-out score is deterministic
    for name, rows in (("tasks.jsonl", train), ("heldout.jsonl", held)):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return {"tasks": len(train), "heldout": len(held)}


def main() -> None:
    """Build the data (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "data")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--heldout", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.out, args.count, args.heldout, args.seed))


if __name__ == "__main__":
    main()
