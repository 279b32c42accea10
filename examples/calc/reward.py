"""The calc reward, and the evaluator that reports it after the agent exits.

Rule (as calc-x scores it): the final reply's number after `### ANSWER:` (else the last number in
the reply) is compared with the gold answer; reward 1 when they are within 1e-2, else 0. With a
format penalty `p` (`CALC_FORMAT_PENALTY`, default 0), a reply without the `### ANSWER:` line,
or no reply at all, scores `-p` instead of 0, pushing the model toward the expected format.

    python -m examples.calc.reward     (as the run's evaluator_command)
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.evaluate import evaluator_main

TOLERANCE = 1e-2
_MARKER = re.compile(r"###\s*ANSWER:\s*(.*)", re.S | re.I)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def parse_number(text: str) -> float | None:
    """The first number of `text` (`1,250`, `-3.5`, `7/2` allowed), or None."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    token = match.group().replace(",", "")
    try:
        if "/" in token:
            top, bottom = token.split("/")
            return float(top) / float(bottom) if float(bottom) else None
        return float(token)
    except ValueError:
        return None


def score(answer: str | None, gold: str, format_penalty: float = 0.0) -> float:
    """The reward of a final reply against the gold answer (see the module docstring).

    With `### ANSWER:` the number after it counts: 1.0 within 1e-2, else 0.0. Without it the last
    number of the reply counts, less the penalty: `1 - p` when right, `-p` when wrong or absent.
    """
    if answer is None:
        return -format_penalty
    marked = _MARKER.search(answer)
    if marked is not None:
        value = parse_number(marked.group(1))
        return 1.0 if value is not None and abs(value - float(gold)) <= TOLERANCE else 0.0
    numbers = _NUMBER.findall(answer)
    value = parse_number(numbers[-1]) if numbers else None
    right = value is not None and abs(value - float(gold)) <= TOLERANCE
    return (1.0 if right else 0.0) - format_penalty


def evaluate(task: dict[str, Any], result: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The reward of one rollout and the metrics the trainer averages per step."""
    penalty = float(os.environ.get("CALC_FORMAT_PENALTY", "0"))
    reward = score(result.get("answer"), str(task["answer"]), penalty)
    answer = result.get("answer") or ""
    metrics = {"tool_used": float(result.get("tool_calls", 0) > 0), "formatted": float("ANSWER:" in answer.upper())}
    return reward, metrics


if __name__ == "__main__":
    evaluator_main(evaluate)
