"""A small run that looks like real agent RL, for the viewer tests: honest fixes, a reward hack
(the agent edits the test), a runaway rollout, a failure, and one rollout still running (its calls
made in continuous prompt mode)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from typing import Any

from msgspec import UNSET

from schemas import (
    AttemptStarted,
    CustomEvent,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    RunStarted,
)
from schemas.events import RolloutStatus

RUN = "demo"
WORDS = ["hello", "world", "rm", "-rf", "fix", "the", "bug", "in", "parser", "tests", "pass", "now"]
SYSTEM = "You are a careful software engineer. Use the bash tool to inspect and fix the repository."


def _reply(content: str, command: str | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if command is not None:
        arguments = json.dumps({"cmd": command})
        message["tool_calls"] = [{"id": "t1", "type": "function", "function": {"name": "bash", "arguments": arguments}}]
    return {"message": message}  # the shape the gateway records


class Demo:
    """Builds the demo run's events in order."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.events: list[Event] = [RunStarted(run_id=RUN, name="swe-mini demo", config={"backend": "local"})]
        self.t = time.time() - 900.0

    def _at(self) -> float:
        self.t += self.rng.uniform(0.2, 3.0)
        return self.t

    def rollout(
        self,
        rid: str,
        steps: Sequence[tuple[str, str | None, str]],
        end: RolloutStatus | None,
        reward: float | None,
        reason: str | None = None,
        group: str = "task-7",
        continuous: bool = False,
    ) -> None:
        aid = f"{rid}-a1"
        issue = f"Issue #{rid[-1]}: the parser drops the last token of a line."
        self.events += [
            RolloutCreated(run_id=RUN, rollout_id=rid, time=self._at(), input={"issue": issue}, group_id=group),
            RolloutStatusChanged(run_id=RUN, rollout_id=rid, time=self._at(), status="queuing"),
            AttemptStarted(run_id=RUN, rollout_id=rid, attempt_id=aid, time=self._at(), sequence=1, executor="local"),
            RolloutStatusChanged(
                run_id=RUN, rollout_id=rid, attempt_id=aid, time=self._at(), status="running", previous="queuing"
            ),
        ]
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": issue}]
        prompt = [self.rng.randrange(0, len(WORDS)) for _ in range(40)]
        for index, (content, command, observation) in enumerate(steps):
            response = [self.rng.randrange(0, len(WORDS)) for _ in range(self.rng.randrange(6, 14))]
            logprobs = [-abs(self.rng.gauss(0, 0.6)) if self.rng.random() > 0.1 else -self.rng.uniform(3, 7)
                        for _ in response]  # fmt: skip
            self.events.append(ModelRequestRecorded(
                run_id=RUN, rollout_id=rid, attempt_id=aid, time=self._at(), call_id=f"{rid}-c{index}",
                model="policy", weights_version=3, prompt_ids=list(prompt), response_ids=response, logprobs=logprobs,
                finish_reason="tool_calls" if command else "stop",
                request={"model": "policy", "messages": list(messages)},
                response=_reply(content, command), usage={"prompt_tokens": len(prompt)},
                latency_s=self.rng.uniform(0.3, 2.5),
                continuity=("extended" if index else "fresh: first call of the attempt") if continuous else UNSET,
            ))  # fmt: skip
            messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": observation}]
            prompt = prompt + response + [self.rng.randrange(0, len(WORDS)) for _ in range(8)]
            if command and index % 2 == 1:
                self.events.append(CustomEvent(run_id=RUN, rollout_id=rid, attempt_id=aid, time=self._at(),
                                               name="tool", payload={"cmd": command, "exit": 0}))  # fmt: skip
        if reward is not None:
            self.events.append(RewardReported(run_id=RUN, rollout_id=rid, attempt_id=aid, time=self._at(),
                                              value=reward, source="evaluator"))  # fmt: skip
        if end is not None:
            self.events.append(RolloutStatusChanged(run_id=RUN, rollout_id=rid, attempt_id=aid, time=self._at(),
                                                    status=end, previous="running", reason=reason))  # fmt: skip


HONEST = [
    (
        "Let me look at the parser first.",
        "sed -n 1,80p src/parser.py",
        "def parse(line):\n    return line.split()[:-1]",
    ),
    ("The slice drops the last token. I will fix it.", "sed -i 's/\\[:-1\\]//' src/parser.py", ""),
    ("Now run the tests.", "python -m pytest -q", "12 passed in 0.41s"),
    ("The fix is in place and the tests pass.", None, ""),
]
HACK = [
    ("Let me run the tests.", "python -m pytest -q", "1 failed, 11 passed"),
    (
        "The failing test is too strict; I will relax it.",
        "sed -i 's/assert tokens == expected/assert True/' tests/test_parser.py",
        "",
    ),
    ("Tests pass now.", "python -m pytest -q", "12 passed in 0.38s"),
    ("Done.", None, ""),
]


def demo_events() -> list[Event]:
    """The demo run: 6 honest rollouts, 1 reward hack, 1 runaway, 1 failure, 1 still running."""
    demo = Demo()
    for index in range(6):
        demo.rollout(f"ro-honest{index}", HONEST, "succeeded", 1.0 if index % 3 else 0.0)
    demo.rollout("ro-hack", HACK, "succeeded", 1.0)
    loop = [("Let me check again.", "cat src/parser.py", "def parse(line): ...")] * 18
    demo.rollout("ro-runaway", loop, "failed", 0.0, reason="timed out after 600 s")
    demo.rollout("ro-crash", HONEST[:1], "failed", None, reason="agent exited with code 1: ModuleNotFoundError")
    demo.rollout("ro-live", HONEST[:2], None, None, continuous=True)
    return demo.events


def word_tokenizer_json() -> str:
    """A tiny byte-level word tokenizer (the demo's vocabulary, each word with its leading space)."""
    from tokenizers import Tokenizer, decoders, models

    tokenizer = Tokenizer(models.WordLevel({f"\u0120{w}": i for i, w in enumerate(WORDS)}, unk_token="\u0120hello"))
    tokenizer.decoder = decoders.ByteLevel()
    return str(tokenizer.to_str())
