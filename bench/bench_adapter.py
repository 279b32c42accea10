"""Adapter throughput: events → `collect_rollouts` → `build_step`, against decoding the same events.

Synthetic agent rollouts (default 10,000 rollouts × 10 distinct calls, contexts growing to ~4k
tokens): linear multi-turn conversations, with some retried calls (deduplicated), some rollouts
running two interleaved sub-agents (two chains), and some retokenization drift (a chain split).
Every event is encoded to JSON as the stream holds it. Per step of rollouts the script times:

- decode: `schemas.codec.decode` of the encoded `model_request` payloads (the floor: any trainer
  must at least decode what it replays);
- extract: `collect_rollouts` over the decoded events of the step;
- build_step: dedup → merge → advantages → loss weights (exact merge, and per-call for comparison).

The whole workload is ~260M call tokens, about 2 GB as Python lists and more as JSON, so it is
generated lazily, one step of rollouts (whole groups) at a time; only timings are kept.

    .venv/bin/python bench/bench_adapter.py                 # the full 10k × 10 × 4k run
    .venv/bin/python bench/bench_adapter.py --rollouts 640  # a quick look
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator

from schemas import (
    AttemptStarted,
    Event,
    ModelRequestRecorded,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    decode,
    encode,
)
from trainer.core import AdapterConfig, build_step, collect_rollouts

VOCAB = 151_000
RUN = "bench"


class Workload:
    """Generates one rollout's events: conversations, retries, sub-agents and drift, seeded."""

    def __init__(self, rng: random.Random, calls: int, context: int) -> None:
        self.rng = rng
        self.calls = calls
        self.turn = 150  # mean response and mean observation length
        self.first_prompt = max(64, context - calls * self.turn - (calls - 1) * self.turn)

    def tokens(self, n: int) -> list[int]:
        return self.rng.choices(range(VOCAB), k=n)

    def length(self) -> int:
        return self.rng.randint(self.turn // 2, self.turn * 3 // 2)

    def rollout(self, rollout_id: str, group_id: str, system: list[int]) -> list[Event]:
        rng = self.rng
        head: list[Event] = [
            RolloutCreated(run_id=RUN, rollout_id=rollout_id, group_id=group_id),
            RolloutStatusChanged(run_id=RUN, rollout_id=rollout_id, status="queuing"),
            AttemptStarted(run_id=RUN, rollout_id=rollout_id, attempt_id="a1", sequence=1),
            RolloutStatusChanged(run_id=RUN, rollout_id=rollout_id, attempt_id="a1", status="running"),
        ]
        agents = 2 if rng.random() < 0.2 else 1
        prompts = [system + self.tokens(self.first_prompt - len(system)) for _ in range(agents)]
        calls: list[Event] = []
        for n in range(self.calls):
            a = rng.randrange(agents)
            response = self.tokens(self.length())
            attempts = 2 if rng.random() < 0.1 else 1  # a retried call: same prompt, the last one counts
            for attempt in range(attempts):
                sampled = response if attempt == attempts - 1 else self.tokens(self.length())
                calls.append(
                    ModelRequestRecorded(
                        run_id=RUN,
                        rollout_id=rollout_id,
                        attempt_id="a1",
                        call_id=f"{rollout_id}-{n}-{attempt}",
                        weights_version=7,
                        prompt_ids=prompts[a],
                        response_ids=sampled,
                        logprobs=[-rng.random() for _ in sampled],
                    )
                )
            echoed = self.tokens(len(response)) if rng.random() < 0.05 else response  # drift
            prompts[a] = prompts[a] + echoed + self.tokens(self.length())
        tail: list[Event] = [
            RewardReported(run_id=RUN, rollout_id=rollout_id, attempt_id="a1", value=float(rng.random() < 0.5)),
            RolloutStatusChanged(run_id=RUN, rollout_id=rollout_id, attempt_id="a1", status="succeeded"),
        ]
        return head + calls + tail


def steps(args: argparse.Namespace) -> Iterator[list[bytes]]:
    """Encoded events of each step (whole groups), generated lazily."""
    rng = random.Random(args.seed)
    work = Workload(rng, args.calls, args.context)
    system = work.tokens(200)
    made = 0
    while made < args.rollouts:
        payloads: list[bytes] = []
        for _ in range(min(args.step_rollouts, args.rollouts - made)):
            group = f"g{made // args.group_size}"
            payloads.extend(encode(e) for e in work.rollout(f"ro{made}", group, system))
            made += 1
        yield payloads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=10, help="distinct calls per rollout (retries come on top)")
    parser.add_argument("--context", type=int, default=4096, help="final context length of a conversation")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--step-rollouts", type=int, default=64, help="rollouts per optimizer step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    exact, per_call = AdapterConfig(), AdapterConfig(merge="per-call")
    t = {"decode": 0.0, "extract": 0.0, "exact": 0.0, "per-call": 0.0}
    calls = call_tokens = samples = sample_tokens = per_call_tokens = rollouts = deduped = 0
    started = time.perf_counter()
    for payloads in steps(args):
        requests = [p for p in payloads if b'"type":"model_request"' in p[:64]]
        t0 = time.perf_counter()
        for p in requests:
            decode(p)
        t1 = time.perf_counter()
        events = [decode(p) for p in payloads]
        t2 = time.perf_counter()
        collected = collect_rollouts(events)
        t3 = time.perf_counter()
        step = build_step(collected.rollouts, exact)
        t4 = time.perf_counter()
        per = build_step(collected.rollouts, per_call)
        t5 = time.perf_counter()
        t["decode"] += t1 - t0
        t["extract"] += t3 - t2
        t["exact"] += t4 - t3
        t["per-call"] += t5 - t4
        for r in collected.rollouts:
            calls += len(r.calls)
            call_tokens += sum(len(c.prompt_ids) + len(c.response_ids) for c in r.calls)
        rollouts += step.stats.rollouts
        deduped += step.stats.calls_deduped
        samples += step.stats.samples
        sample_tokens += step.stats.tokens
        per_call_tokens += per.stats.tokens
    wall = time.perf_counter() - started

    mtok = call_tokens / 1e6
    print(f"workload: {rollouts} rollouts, {calls} recorded calls ({deduped} retries), {mtok:.1f}M call tokens")
    print(f"          steps of {args.step_rollouts} rollouts generated lazily; wall {wall:.1f} s incl. generation")
    ratio = (calls - deduped) / samples
    print(f"exact merge: {samples} samples, {ratio:.2f} calls/sample, {sample_tokens / 1e6:.1f}M sample tokens")
    print(f"per-call:    {per_call_tokens / 1e6:.1f}M sample tokens")
    print(f"{'stage':<28}{'seconds':>9}{'calls/s':>12}{'call tokens/s':>16}")
    rows = [
        ("decode model_request JSON", t["decode"]),
        ("collect_rollouts", t["extract"]),
        ("build_step (exact)", t["exact"]),
        ("build_step (per-call)", t["per-call"]),
    ]
    for name, seconds in rows:
        print(f"{name:<28}{seconds:>9.2f}{calls / seconds:>12,.0f}{call_tokens / seconds:>16,.0f}")
    print(f"build_step (exact) costs {t['exact'] / t['decode']:.2f}x the raw decode of the same calls")


if __name__ == "__main__":
    main()
