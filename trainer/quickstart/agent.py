"""The quickstart's agent harness: a plain `openai` tool-calling loop, run once per rollout.

Nothing in it knows about training. It reads its task, talks to whatever OpenAI-compatible
endpoint `OPENAI_BASE_URL` names (the Rollwire proxy, when the controller runs it), executes the
`lookup` tool when the model calls it, sends the result back, and takes the model's next plain
reply as the answer. Then it reports the reward (1 when the answer is the task's value) and a
`metrics` event (did it use the tool, how many turns) that the trainer averages per step.
With `QUICKSTART_REWARD=tool` the reward is 1 for calling the tool at all (a shaping reward the
CI smoke test uses, so a barely warm-started model still gets rewards that differ within a group).

    python -m trainer.quickstart.agent        (with the environment the controller sets)

Each request passes a seed derived from `AGENT_SEED`, the rollout's place in the run and the turn,
so a rollout samples the same tokens from the same weights every time it runs.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import msgspec
from openai import OpenAI

from services import agentkit
from trainer.quickstart.task import TOOLS, Task, first_messages, reward, run_tool

REWARD_ENV = "QUICKSTART_REWARD"
MAX_TURNS = 3
MAX_TOKENS = 48
TEMPERATURE = 1.0


class Episode(msgspec.Struct, frozen=True, kw_only=True):
    """What happened in one conversation: the final answer (None if there was none) and the tool use."""

    answer: str | None
    tool_calls: int
    turns: int


def request_seed(seed_base: str, turn: int) -> int:
    """A per-request sampling seed: the same rollout and turn always sample alike."""
    digest = hashlib.sha256(f"{seed_base}/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def seed_base(attempt: agentkit.Attempt) -> str:
    """What a rollout's seeds derive from: `AGENT_SEED` and the rollout id without the run id in it.

    Rollout ids are `<run>-g<task number>-r<repeat>`, so two runs with the same seed sample alike.
    """
    rollout = attempt.rollout_id.removeprefix(attempt.run_id)
    return f"{os.environ.get('AGENT_SEED', '0')}/{rollout}"


def run_episode(client: OpenAI, task: Task, *, model: str, seed_base: str) -> Episode:
    """Talk to the model until it answers without a tool call (at most `MAX_TURNS` requests)."""
    messages: list[dict[str, Any]] = first_messages(task)
    tool_calls = 0
    for turn in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=TEMPERATURE,
            max_tokens=MAX_TOKENS,
            seed=request_seed(seed_base, turn),
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return Episode(answer=message.content, tool_calls=tool_calls, turns=turn + 1)
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls if c.type == "function"]
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
                    for i, name, arguments in calls
                ],
            }
        )
        for call_id, name, arguments in calls:
            messages.append({"role": "tool", "tool_call_id": call_id, "content": run_tool(task, name, arguments)})
            tool_calls += 1
    return Episode(answer=None, tool_calls=tool_calls, turns=MAX_TURNS)


def main() -> None:
    """Run one rollout: read the task, run the episode, report the reward and the metrics."""
    attempt = agentkit.current()
    task = msgspec.convert(attempt.read_input(), Task)
    client = OpenAI(max_retries=3, timeout=120.0)
    model = os.environ.get("ROLLWIRE_MODEL", "policy")
    episode = run_episode(client, task, model=model, seed_base=seed_base(attempt))
    correct = reward(task, episode.answer)
    tool_used = float(episode.tool_calls > 0)
    attempt.emit("metrics", {"tool_used": tool_used, "turns": episode.turns, "correct": correct})
    attempt.report_reward(tool_used if os.environ.get(REWARD_ENV) == "tool" else correct)


if __name__ == "__main__":
    main()
