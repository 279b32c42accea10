"""The realmodel reward, and the evaluator that reports it after the agent exits.

Rule: the final reply (the first one without a tool call) must hold the gold integer as its last
number: reward 1 when it does, exactly, else 0. No reply (the agent ran out of turns, or the model
only called tools) scores 0. Metrics: whether the calculator was used, whether the reply was a
number only.

    python -m examples.realmodel.reward     (as the run's evaluator_command)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.evaluate import evaluator_main

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ONLY_NUMBER = re.compile(r"\s*-?\d+(?:\.0+)?\s*\.?\s*")


def score(answer: str | None, gold: int) -> float:
    """1.0 when the reply's last number is exactly `gold` (thousands separators allowed), else 0.0."""
    if not answer:
        return 0.0
    numbers = _NUMBER.findall(answer.replace(",", ""))
    if not numbers:
        return 0.0
    return 1.0 if float(numbers[-1]) == gold else 0.0


def evaluate(task: dict[str, Any], result: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The reward of one rollout and the metrics the trainer averages per step."""
    answer = result.get("answer")
    reward = score(answer, int(task["answer"]))
    metrics = {
        "tool_used": float(result.get("tool_calls", 0) > 0),
        "number_only": float(bool(answer) and _ONLY_NUMBER.fullmatch(answer or "") is not None),
    }
    return reward, metrics


if __name__ == "__main__":
    evaluator_main(evaluate)
