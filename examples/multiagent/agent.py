"""A multi-agent harness over the plain `openai` client: a writer fans out, a frozen checker judges, a rewriter edits.

One rollout, in the shape such harnesses take when deployed:

1. the **writer** fans one prompt out to `FAN_OUT` parallel drafts (identical requests, sent
   concurrently, every answer used);
2. the **checker**, a frozen model the run does not train, reads the drafts and picks one;
3. the **rewriter** edits the picked draft; its first request is retried once (the harness
   rejects the first answer and sends the very same request again), so one call is a true retry;
4. the writer finishes from its first draft's conversation (a follow-up turn of that chain).

Each role names itself through its base URL (`agentkit.agent_base_url`), except the checker,
which keeps the attempt's plain base URL and sends the `X-Rollwire-Agent` header instead, as a
harness that cannot vary its URL would. The run routes the checker to its own registered model.
The reward is a deterministic function of the final text, so a group's rewards differ.

    rollwire train examples/multiagent/train.toml        (or any run whose command runs this file)
"""

from __future__ import annotations

import os
import threading
from typing import Any

from openai import OpenAI

from services import agentkit

FAN_OUT = 3
MAX_TOKENS = 8
DRAFT_TOKENS = 48
"""The drafts run longer than the other calls: a twin that reaches the gateway after another has been
recorded looks like a retry of it, so the drafts must still overlap when one thread starts late."""
SAMPLING: dict[str, Any] = {"temperature": 1.0, "max_tokens": MAX_TOKENS}


def _client(agent: str | None) -> OpenAI:
    if agent is None:
        return OpenAI(max_retries=2, timeout=60, default_headers={"X-Rollwire-Agent": "checker"})
    return OpenAI(base_url=agentkit.agent_base_url(agent), max_retries=2, timeout=60)


def _ask(client: OpenAI, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> str:
    model = os.environ.get("ROLLWIRE_MODEL", "policy")
    sampling = {**SAMPLING, "max_tokens": max_tokens}
    reply = client.chat.completions.create(model=model, messages=messages, **sampling)  # type: ignore[arg-type]
    return str(reply.choices[0].message.content or "")


def fan_out(client: OpenAI, messages: list[dict[str, str]]) -> list[str]:
    """`FAN_OUT` identical requests, released together so they run concurrently."""
    drafts = [""] * FAN_OUT
    start = threading.Barrier(FAN_OUT)

    def one(i: int) -> None:
        start.wait()
        drafts[i] = _ask(client, messages, DRAFT_TOKENS)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(FAN_OUT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return drafts


def main() -> None:
    """Run the four stages of the module docstring, then report the reward."""
    task = agentkit.read_input()
    writer, rewriter, checker = _client("writer"), _client("rewriter"), _client(None)
    brief = [
        {"role": "system", "content": "You write one short sentence."},
        {"role": "user", "content": str(task["topic"])},
    ]
    drafts = fan_out(writer, brief)
    listing = "\n".join(f"{i}: {d}" for i, d in enumerate(drafts))
    verdict = _ask(checker, [{"role": "user", "content": f"Pick the best draft:\n{listing}"}])
    picked = drafts[len(verdict) % FAN_OUT]
    edit = [{"role": "user", "content": f"Rewrite: {picked}"}]
    _ask(rewriter, edit)  # rejected by the harness: the request is sent again below
    rewritten = _ask(rewriter, edit)
    final = _ask(writer, [*brief, {"role": "assistant", "content": drafts[0]},
                          {"role": "user", "content": f"Finish it. Editor says: {rewritten}"}])  # fmt: skip
    agentkit.emit("answer", {"drafts": drafts, "verdict": verdict, "rewritten": rewritten, "final": final})
    agentkit.report_reward(float(len(final) % 3) / 2.0)


if __name__ == "__main__":
    main()
