"""The quickstart's agent harness: a plain `openai` tool-calling loop, run once per rollout.

Nothing in it knows about training. It reads its task, talks to whatever OpenAI-compatible
endpoint `OPENAI_BASE_URL` names (the Rollwire proxy, when the controller runs it), executes the
`lookup` tool when the model calls it, sends the result back, and takes the model's next plain
reply as the answer. Then it reports the reward (1 when the answer is the task's value) and a
`metrics` event (did it use the tool, how many turns) that the trainer averages per step.
With `QUICKSTART_REWARD=tool` the reward is 1 for calling the tool at all (a shaping reward the
CI smoke test uses, so a barely warm-started model still gets rewards that differ within a group).

    python -m trainer.quickstart.agent        (with the environment the controller sets)

A turn that calls the tool ends at `</tool_call>` (a stop string): the model's turn is over once
its call is written, and nothing it might add after the call (which the tool-call parser would
drop) can make the conversation the harness sends back differ from the tokens it sampled.

Each request passes a seed derived from `AGENT_SEED`, the rollout's place in the run and the turn,
so a rollout samples the same tokens from the same weights every time it runs.
"""

from __future__ import annotations

import hashlib
import os
import ssl
from collections.abc import Callable
from typing import Any

import certifi
import httpx
import msgspec
from openai import DefaultHttpxClient, OpenAI

from services import agentkit
from trainer.quickstart.task import TOOLS, Task, first_messages, reward, run_tool

try:  # the HTTP library under the installed `openai` (httpx2 in recent releases, httpx before)
    import httpx2 as _http
except ImportError:  # pragma: no cover - depends on the openai release
    import httpx as _http  # type: ignore[no-redef]

# One TLS context per process, made at import: building one loads the CA bundle (tens of ms of
# CPU), and forked agents inherit this one instead of each building its own.
_TLS = ssl.create_default_context(cafile=certifi.where())

REWARD_ENV = "QUICKSTART_REWARD"
TOOL_CALL_END = "</tool_call>"
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


def run_episode(
    client: OpenAI, task: Task, *, model: str, seed_base: str, tool: Callable[[Task, str, str], str] = run_tool
) -> Episode:
    """Talk to the model until it answers without a tool call (at most `MAX_TURNS` requests).

    `tool(task, name, arguments)` executes a call (the task's `lookup` by default).
    """
    messages: list[dict[str, Any]] = first_messages(task)
    tool_calls = 0
    for turn in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=TEMPERATURE,
            max_tokens=MAX_TOKENS,
            stop=[TOOL_CALL_END],
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
            messages.append({"role": "tool", "tool_call_id": call_id, "content": tool(task, name, arguments)})
            tool_calls += 1
    return Episode(answer=None, tool_calls=tool_calls, turns=MAX_TURNS)


def _canned_reply(turn: int) -> dict[str, Any]:
    """A chat completion as an OpenAI server would answer: a `lookup` call first, then an answer."""
    if turn == 0:
        call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "river"}'}}
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    else:
        message = {"role": "assistant", "content": "garden"}
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if turn == 0 else "stop"}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return {
        "id": "warmup",
        "object": "chat.completion",
        "created": 0,
        "model": "warmup",
        "choices": [choice],
        "usage": usage,
    }


def warmup() -> None:
    """Run one whole episode against a canned in-memory server (no network).

    A fork server calls this once before forking agents, so what the first request of a process
    builds lazily (request and response schemas, platform headers, imports) is built once, not in
    every agent.
    """
    turns = iter(range(MAX_TURNS))

    def answer(request: Any) -> Any:
        return _http.Response(200, json=_canned_reply(next(turns)))

    transport = _http.MockTransport(answer)
    client = OpenAI(
        api_key="warmup", base_url="http://warmup.invalid/v1", http_client=DefaultHttpxClient(transport=transport)
    )
    run_episode(client, Task(task_id="warmup", key="river", value="garden"), model="warmup", seed_base="warmup")
    client.close()
    # agentkit posts events with httpx, whose transport and IDNA codec load on first use.
    httpx.Client().close()
    "warmup.invalid".encode("idna")


def main(tool: Callable[[Task, str, str], str] = run_tool) -> None:
    """Run one rollout: read the task, run the episode, report the reward and the metrics."""
    attempt = agentkit.current()
    task = msgspec.convert(attempt.read_input(), Task)
    client = OpenAI(max_retries=3, timeout=120.0, http_client=DefaultHttpxClient(verify=_TLS))
    model = os.environ.get("ROLLWIRE_MODEL", "policy")
    episode = run_episode(client, task, model=model, seed_base=seed_base(attempt), tool=tool)
    correct = reward(task, episode.answer)
    tool_used = float(episode.tool_calls > 0)
    attempt.emit("metrics", {"tool_used": tool_used, "turns": episode.turns, "correct": correct})
    attempt.report_reward(tool_used if os.environ.get(REWARD_ENV) == "tool" else correct)


if __name__ == "__main__":
    main()
