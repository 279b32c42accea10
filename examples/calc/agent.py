"""The calc agent: a plain `openai` tool-calling loop with a `calculator` tool.

    python examples/calc/agent.py '{"question": "..."}'     (any OpenAI-compatible server)

It asks the model to solve the problem, executes the `calculator` calls the model makes (safe AST
evaluation, `calculator.py`) and ends on the first reply without a tool call: the final answer,
expected as `### ANSWER: <number>`. Under Rollwire the controller runs it with `OPENAI_BASE_URL`
set to the attempt's proxy; `examples/calc/reward.py` scores `result.json` afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.calc.calculator import TOOL, run_tool
from examples.toolloop import client, read_input, run_episode, write_result

SYSTEM_PROMPT = "Solve the problem. Use the calculator for arithmetic. End with ### ANSWER: <number>"
MAX_TURNS = 4
MAX_TOKENS = 64


def main() -> None:
    """Run one episode on the task and write `result.json`."""
    task = read_input()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": str(task["question"])}]
    episode = run_episode(client(), messages, [TOOL], run_tool, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS)
    write_result(episode)
    print(f"answer={episode.answer!r} tool_calls={episode.tool_calls} results={episode.tool_results}")


if __name__ == "__main__":
    main()
