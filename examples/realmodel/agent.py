"""The realmodel agent: a plain `openai` tool-calling loop with a `calculator` tool.

    python examples/realmodel/agent.py '{"question": "What is 47 * 8 + 13?"}'   (any OpenAI-compatible server)

It asks the model the question with the `calculator` tool offered, runs the calls the model makes
(the calc example's safe AST walker) and ends on the first reply without a tool call, which should
hold the number. It knows only `OPENAI_BASE_URL`, `OPENAI_API_KEY` and its input; under Rollwire
the controller points it at the attempt's proxy and `reward.py` scores `result.json` afterwards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.calc.calculator import TOOL, run_tool
from examples.toolloop import client, read_input, run_episode, write_result

SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool for arithmetic, then reply with the final answer "
    "as a number only."
)
MAX_TURNS = 3
MAX_TOKENS = 96


def main() -> None:
    """Run one episode on the task and write `result.json`."""
    task = read_input()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": str(task["question"])}]
    # A task may fix its own temperature: the held-out tasks ask for greedy answers (0), so that the
    # before/after comparison is not sampling noise.
    temperature = float(task.get("temperature", os.environ.get("REALMODEL_TEMPERATURE", "1.0")))
    episode = run_episode(
        client(), messages, [TOOL], run_tool, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS, temperature=temperature
    )
    write_result(episode)
    print(f"answer={episode.answer!r} tool_calls={episode.tool_calls} results={episode.tool_results}")


if __name__ == "__main__":
    main()
