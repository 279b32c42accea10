"""The search agent (Search-R1 style): a plain `openai` loop with a bounded BM25 `search` tool.

    SEARCH_INDEX=examples/search/data/index python examples/search/agent.py '{"question": "..."}'

The model may search as often as it likes, up to `MAX_SEARCHES` per question (then the tool says
so), and answers in `<answer>...</answer>`. A call to an unknown tool or with arguments that are
not `{"query": "..."}` is an invalid action: the episode stops there (and scores 0). The index is
where `SEARCH_INDEX` says (the run's `train.toml` sets it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.search.retrieval import TOOL, Searcher, invalid_action
from examples.toolloop import client, read_input, run_episode, write_result

SYSTEM_PROMPT = "Answer the question. Use search to find facts. Reply with <answer>the answer</answer>"
MAX_TURNS = 6
MAX_TOKENS = 48


def main() -> None:
    """Run one episode on the task and write `result.json`."""
    task = read_input()
    searcher = Searcher(Path(os.environ.get("SEARCH_INDEX", Path(__file__).parent / "data" / "index")))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": str(task["question"])}]
    episode = run_episode(
        client(), messages, [TOOL], searcher.run_tool, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS,
        is_valid=invalid_action,
    )  # fmt: skip
    write_result(episode)
    print(f"answer={episode.answer!r} searches={episode.tool_calls} invalid={episode.invalid}")


if __name__ == "__main__":
    main()
