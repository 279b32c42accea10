"""The search reward (Search-R1's exact match), and the evaluator that reports it.

Rule: the text inside the final reply's last `<answer>...</answer>` is normalized (lower case,
punctuation and the articles a/an/the removed, whitespace collapsed, as SQuAD and Search-R1 do)
and compared with each normalized gold answer: 1 on an exact match, else 0. An invalid action
scores 0: a malformed tool call (the episode stopped there), no final reply, or a reply without
`<answer>` tags.

    python -m examples.search.reward     (as the run's evaluator_command)
"""

from __future__ import annotations

import re
import string
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.evaluate import evaluator_main

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def normalize(text: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def extract_answer(reply: str | None) -> str | None:
    """The last `<answer>` block of the reply, or None (an invalid action)."""
    found = _ANSWER.findall(reply or "")
    return found[-1] if found else None


def score(reply: str | None, golden: list[str], invalid: str | None = None) -> float:
    """1.0 when the answer exactly matches a gold answer after normalization; 0.0 otherwise or if invalid."""
    answer = extract_answer(reply)
    if invalid is not None or answer is None:
        return 0.0
    return 1.0 if normalize(answer) in {normalize(g) for g in golden} else 0.0


def evaluate(task: dict[str, Any], result: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The reward of one rollout and the metrics the trainer averages per step."""
    reward = score(result.get("answer"), list(task["golden_answers"]), result.get("invalid"))
    valid = result.get("invalid") is None and extract_answer(result.get("answer")) is not None
    return reward, {"searches": float(result.get("tool_calls", 0)), "valid": float(valid)}


if __name__ == "__main__":
    evaluator_main(evaluate)
