"""An evaluator: runs after the agent exited 0, in its workspace, with the evaluator's token.

It scores the agent's `answer.txt` against the input's answer and reports the reward; when the
run sets `reward_from: "evaluator"`, this is the only reward that counts.
"""

from __future__ import annotations

from pathlib import Path

from services import agentkit


def main() -> None:
    """Report 1.0 when the agent's answer file holds the expected answer, else 0.0."""
    task = agentkit.read_input()
    answer = Path("answer.txt").read_text(encoding="utf-8") if Path("answer.txt").exists() else ""
    value = 1.0 if str(task.get("answer", "")) in answer else 0.0
    print(f"answer={answer!r} expected={task.get('answer')!r} reward={value}")
    agentkit.report_reward(value, name="evaluator")


if __name__ == "__main__":
    main()
