"""A realistic recorded run, as the gateway and controller would have written it, for replay tests.

Rollouts run in groups, interleaved on the stream. Each makes a multi-turn conversation whose
prompts extend the previous call (merged into one sample), with the quirks real harnesses show:
retried calls (same prompt again), a re-rendered conversation that breaks the prefix (a new
sample), failed calls, a crashed first attempt that was retried, validation rollouts, a rollout
that never reported a reward, ungrouped rollouts and one that failed for good.
"""

from __future__ import annotations

import random
from itertools import count

from schemas import (
    AttemptStarted,
    CustomEvent,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
)


def _call(run_id: str, rollout_id: str, attempt: str, n: int, prompt: list[int], response: list[int],
          rng: random.Random, status: str = "ok", weights_version: int = 1,
          action: str | None = None) -> ModelRequestRecorded:  # fmt: skip
    message: dict[str, object] = {"role": "assistant", "content": f"thinking {n}"}
    if action is not None:
        function = {"name": "bash", "arguments": f'{{"command": "{action}"}}'}
        message["tool_calls"] = [{"id": f"tc{n}", "type": "function", "function": function}]
    return ModelRequestRecorded(
        run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, call_id=f"{rollout_id}-{attempt}-{n}",
        status=status,  # type: ignore[arg-type]
        prompt_ids=prompt if status == "ok" else [], response_ids=response if status == "ok" else [],
        logprobs=[-rng.random() for _ in response] if status == "ok" else [], weights_version=weights_version,
        model="policy", finish_reason="stop", request={"messages": [{"role": "user", "content": "solve it"}]},
        response={"message": message}, usage={"prompt_tokens": len(prompt), "completion_tokens": len(response)},
    )  # fmt: skip


def _conversation(run_id: str, rollout_id: str, attempt: str, rng: random.Random, turns: int,
                  tokens: count[int]) -> list[Event]:  # fmt: skip
    """One attempt's calls: a growing conversation, with a retry, a failure and a re-render."""
    events: list[Event] = []
    sequence = [next(tokens) for _ in range(rng.randint(5, 12))]
    for n in range(turns):
        response = [next(tokens) for _ in range(rng.randint(1, 9))]
        prompt = list(sequence)
        if n > 0 and rng.random() < 0.2:  # the harness re-rendered the history: the prefix breaks
            prompt = [next(tokens), *prompt[1:]]
        if rng.random() < 0.15:  # a retried call: the same prompt, an answer nobody used
            events.append(_call(run_id, rollout_id, attempt, 100 + n, prompt, [next(tokens)], rng))
        if rng.random() < 0.1:
            events.append(_call(run_id, rollout_id, attempt, 200 + n, prompt, [], rng, status="failed"))
        events.append(_call(run_id, rollout_id, attempt, n, prompt, response, rng, weights_version=1 + n % 2))
        sequence = prompt + response + [next(tokens) for _ in range(rng.randint(1, 6))]
    return events


def rollout_events(run_id: str, rollout_id: str, group_id: str | None, rng: random.Random, tokens: count[int],
                   *, mode: str = "train", outcome: str = "succeeded", reward: float | None = None,
                   retried: bool = False, step: int | None = None,
                   step_in_metadata: bool = False) -> list[Event]:  # fmt: skip
    """The whole history of one rollout, in the order its writers would append it."""
    events: list[Event] = [
        RolloutCreated(run_id=run_id, rollout_id=rollout_id, group_id=group_id, mode=mode,  # type: ignore[arg-type]
                       input={"task": f"task {group_id}", "text": "x" * 200},
                       metadata={"step": step} if step_in_metadata and step is not None else {}),
        RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, status="queuing"),
    ]  # fmt: skip
    attempts = ["a1", "a2"] if retried else ["a1"]
    for i, attempt in enumerate(attempts):
        last = i == len(attempts) - 1
        events.append(AttemptStarted(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, sequence=i + 1))
        events.append(RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, status="running"))
        events.extend(_conversation(run_id, rollout_id, attempt, rng, rng.randint(1, 6), tokens))
        if not last:
            events.append(RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, value=0.5))
            events.append(RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt,
                                               status="requeuing", reason="agent crashed"))  # fmt: skip
            continue
        if reward is not None:
            events.append(RewardReported(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt, value=reward))
        events.append(RolloutStatusChanged(run_id=run_id, rollout_id=rollout_id, attempt_id=attempt,
                                           status=outcome))  # type: ignore[arg-type]  # fmt: skip
    if step is not None and not step_in_metadata:
        events.append(CustomEvent(run_id=run_id, rollout_id=rollout_id, name="train_step", payload={"step": step}))
    return events


def interleave(histories: list[list[Event]], rng: random.Random) -> list[Event]:
    """Merge the rollouts' histories as concurrent writers would: each in order, all interleaved."""
    positions = [0] * len(histories)
    live = [i for i, h in enumerate(histories) if h]
    merged: list[Event] = []
    while live:
        i = rng.choice(live)
        merged.append(histories[i][positions[i]])
        positions[i] += 1
        if positions[i] == len(histories[i]):
            live.remove(i)
    return merged


def agent_run(run_id: str, *, groups: int = 4, per_group: int = 4, seed: int = 0,
              steps: int | None = None, step_in_metadata: bool = False) -> list[Event]:  # fmt: skip
    """A run of `groups` × `per_group` training rollouts plus the odd ones (see the module docstring).

    With `steps`, group k is trained in step k % steps and every trained rollout carries a
    `train_step` record (or, with `step_in_metadata`, the step in its creation metadata).
    """
    rng = random.Random(seed)
    tokens = count(1000)
    histories: list[list[Event]] = []
    for g in range(groups):
        step = g % steps if steps else None
        for k in range(per_group):
            rid = f"g{g}r{k}"
            if g == 0 and k == 1:  # succeeded but never reported a reward: dropped
                histories.append(rollout_events(run_id, rid, f"g{g}", rng, tokens, step=step,
                                            step_in_metadata=step_in_metadata))  # fmt: skip
                continue
            histories.append(
                rollout_events(
                    run_id, rid, f"g{g}", rng, tokens, reward=round(rng.random(), 3) if g % 2 else float(k % 2),
                    retried=rng.random() < 0.2, step=step, step_in_metadata=step_in_metadata,
                )
            )  # fmt: skip
    histories.append(rollout_events(run_id, "solo", None, rng, tokens, reward=1.0, step=0 if steps else None,
                                    step_in_metadata=step_in_metadata))  # fmt: skip
    histories.append(rollout_events(run_id, "val", "g0", rng, tokens, mode="val", reward=1.0))
    histories.append(rollout_events(run_id, "broken", "g1", rng, tokens, outcome="failed"))
    return interleave(histories, rng)
