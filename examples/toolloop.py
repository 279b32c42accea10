"""The plain `openai` tool-calling loop the calc and search agents run (no Rollwire import).

An agent built on it knows only `OPENAI_BASE_URL` / `OPENAI_API_KEY` (read by the `openai` client)
and its input (`read_input`): pointed at any OpenAI-compatible server it works the same, which is
what makes it trainable through Rollwire's proxy. It writes what it did to `result.json` in its
working directory, where the example's evaluator reads it after the agent exits.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openai import OpenAI

RESULT_FILE = "result.json"
TOOL_CALL_END = "</tool_call>"


@dataclass
class Episode:
    """One conversation's outcome: the final reply (None if none came), tool use, and an invalid action if any."""

    answer: str | None = None
    tool_calls: int = 0
    turns: int = 0
    invalid: str | None = None
    tool_results: list[str] = field(default_factory=list)


def read_input() -> Any:
    """The task: the first argument, else `ROLLWIRE_INPUT`, else the file `ROLLWIRE_INPUT_FILE` names."""
    if len(sys.argv) > 1:
        return json.loads(sys.argv[1])
    text = os.environ.get("ROLLWIRE_INPUT")
    if text is None:
        text = Path(os.environ["ROLLWIRE_INPUT_FILE"]).read_text(encoding="utf-8")
    return json.loads(text)


def run_episode(
    client: OpenAI,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    run_tool: Callable[[str, str], str],
    *,
    max_turns: int,
    max_tokens: int,
    temperature: float = 1.0,
    is_valid: Callable[[str, str], str | None] = lambda name, arguments: None,
) -> Episode:
    """Call the model until it replies without a tool call, `max_turns` requests, or an invalid action.

    `run_tool(name, arguments)` executes a call; `is_valid(name, arguments)` names what is wrong
    with a call (then the episode stops with `invalid` set), or returns None.
    """
    episode = Episode()
    model = os.environ.get("OPENAI_MODEL", "policy")
    for turn in range(max_turns):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            temperature=temperature,
            max_tokens=max_tokens,
            stop=[TOOL_CALL_END],
        )
        episode.turns = turn + 1
        message = reply.choices[0].message
        if not message.tool_calls:
            episode.answer = message.content or ""
            return episode
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls if c.type == "function"]
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]})  # fmt: skip
        for call_id, name, arguments in calls:
            problem = is_valid(name, arguments)
            if problem is not None:
                episode.invalid = problem
                return episode
            result = run_tool(name, arguments)
            episode.tool_calls += 1
            episode.tool_results.append(result)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return episode


def write_result(episode: Episode, **extra: Any) -> None:
    """Leave the episode in `result.json` for the evaluator."""
    Path(RESULT_FILE).write_text(json.dumps({**asdict(episode), **extra}), encoding="utf-8")


def client() -> OpenAI:
    """An `openai` client configured by the environment alone (OPENAI_BASE_URL, OPENAI_API_KEY)."""
    return OpenAI(max_retries=3, timeout=120.0)
