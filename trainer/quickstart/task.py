"""The quickstart task: answer a question whose answer only a tool knows.

Each task holds a key and a value drawn at random. The question names the key; the `lookup` tool
returns the value stored under it. The value is never in the prompt, so a model that answers
without calling the tool can only guess (one word of `VALUES`: about 1 chance in 32), while a
model that calls `lookup` and copies its result into the answer is always right:

    user       What is the value of {"key": "river"}?
    assistant  <tool_call>{"name": "lookup", "arguments": {"key": "river"}}</tool_call>
    tool       garden
    assistant  garden                                            → reward 1

The reward is 1 when the final answer equals the value, else 0. Learning the task is a real
behaviour change: calling the tool instead of answering straight away.

Keys and values are English words that the tiny model's tokenizer holds as one token each, so a
copy is a single token and the transcripts stay short; no value appears in the system turn (the
tools' description), so the only place a value shows up before the answer is the tool's result.
Everything here is plain data and pure functions, shared by the agent harness, the warm start and
the tests.
"""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec

KEYS: tuple[str, ...] = tuple(
    "book bridge door garden kitchen lamp letter market river road song table ticket tree window city".split()
)
VALUES: tuple[str, ...] = tuple(
    (
        "answer bicycle body call command computer config data email file echo index input message note "
        "number python path print project query question record report search server setup range yaml test "
        "train weather"
    ).split()
)
TOOL_NAME = "lookup"
SYSTEM_PROMPT = "Answer with the value only."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Return the value stored under a key.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]
UNKNOWN_KEY = "unknown"


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """One task: the key the question names and the value `lookup` returns for it."""

    task_id: str
    key: str
    value: str


def make_tasks(count: int, seed: int) -> list[Task]:
    """`count` tasks with keys and values drawn from `random.Random(seed)` (the same every time)."""
    rng = random.Random(seed)
    return [Task(task_id=f"t{seed}-{i}", key=rng.choice(KEYS), value=rng.choice(VALUES)) for i in range(count)]


def question(task: Task) -> str:
    """The user's question, naming the key exactly as the tool call's arguments will.

    Writing the key as `{"key": "river"}` makes copying it into the call an induction pattern
    (continue after `{"key": "` as before), which a two-layer model learns in a few hundred
    warm-start steps; a bare quoted word is not learned in that budget.
    """
    return f"What is the value of {json.dumps({'key': task.key})}?"


def first_messages(task: Task) -> list[dict[str, Any]]:
    """The conversation the agent opens with: the system prompt and the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question(task)}]


def run_tool(task: Task, name: str, arguments: str) -> str:
    """What a tool call returns: the value for the task's key, else a short error the model can read."""
    if name != TOOL_NAME:
        return f"error: no tool named {name}"
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return "error: arguments are not JSON"
    if not isinstance(parsed, dict):
        return "error: arguments are not an object"
    return task.value if parsed.get("key") == task.key else UNKNOWN_KEY


def reward(task: Task, answer: str | None) -> float:
    """1.0 when the final answer is the value (surrounding whitespace ignored), else 0.0."""
    return 1.0 if answer is not None and answer.strip() == task.value else 0.0


def tool_call_message(task: Task, call_id: str = "call_0") -> dict[str, Any]:
    """The assistant turn that calls `lookup` with the task's key (OpenAI shape)."""
    arguments = json.dumps({"key": task.key})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}],
    }


def transcript(task: Task, *, use_tool: bool, guess: str) -> list[dict[str, Any]]:
    """A whole conversation: with the tool (then the right answer) or a direct `guess`."""
    messages = first_messages(task)
    if use_tool:
        messages.append(tool_call_message(task))
        messages.append({"role": "tool", "tool_call_id": "call_0", "content": task.value})
        messages.append({"role": "assistant", "content": task.value})
    else:
        messages.append({"role": "assistant", "content": guess})
    return messages


def write_tasks_jsonl(tasks: list[Task]) -> bytes:
    """Tasks as JSON Lines (the trainer's dataset format: one rollout input per line)."""
    return b"".join(msgspec.json.encode(task) + b"\n" for task in tasks)


def main(argv: list[str] | None = None) -> None:
    """CLI: write `--count` tasks drawn with `--seed` to `--out` as JSON Lines."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Write the quickstart's task dataset (JSON Lines).")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.write_bytes(write_tasks_jsonl(make_tasks(args.count, args.seed)))
    print(f"wrote {args.count} tasks to {args.out}")


if __name__ == "__main__":
    main()
