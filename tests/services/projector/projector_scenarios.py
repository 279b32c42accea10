"""Random but realistic event streams for the projector tests (hypothesis strategies and a load generator)."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import strategies as st

from schemas import (
    AttemptStarted,
    CustomEvent,
    Event,
    ModelRegistered,
    ModelRemoved,
    ModelRequestRecorded,
    PhaseChanged,
    RewardReported,
    RolloutCreated,
    RolloutStatusChanged,
    RunStarted,
    encode,
)
from schemas.events import EventSource
from schemas.runs import RunSpec

RUNS = ("r0", "r1")
ROLLOUTS = ("x0", "x1")
ATTEMPTS = ("a0", "a1", None)
AGENT_FLAG = "flag-from-agent"
"""A custom event an agent wrote with a flag's name: counted as a custom event, never as a flag."""
STATUSES = ("queuing", "preparing", "running", "requeuing", "succeeded", "failed", "cancelled")
POISON = (b"{not json", b'{"type": "no.such.type", "run_id": "r0"}', b'{"type": "reward", "run_id": "bad.id"}')
HACK = {"choices": [{"message": {"content": "", "tool_calls": [
    {"function": {"name": "bash", "arguments": '{"cmd": "sed -i s/assert/pass/ tests/test_x.py"}'}}]}}]}  # fmt: skip


class StreamBuilder:
    """Builds events whose model calls form conversations (extend / retry / fresh prompts)."""

    def __init__(self, seed: int = 0, prefix: str = "") -> None:
        self.rng = random.Random(seed)
        self.prefix = prefix
        self.count = 0
        self.last: dict[tuple[str, str, str | None], tuple[list[int], list[int]]] = {}

    def envelope(self, run: str, rollout: str | None = None, attempt: str | None = None) -> dict[str, Any]:
        self.count += 1
        return {"run_id": run, "rollout_id": rollout, "attempt_id": attempt, "event_id": f"{self.prefix}e{self.count}",
                "time": 1_700_000_000.0 + self.count * 0.25}  # fmt: skip

    def call(self, run: str, rollout: str, attempt: str | None, how: str, ok: bool, hack: bool) -> Event:
        key = (run, rollout, attempt)
        prompt, response = self.last.get(key, ([], []))
        if how == "extend" and prompt:
            prompt = prompt + response + [self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 4))]
        elif how != "retry" or not prompt:
            prompt = [self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 12))]
        response = [self.rng.randrange(1000) for _ in range(self.rng.randrange(0, 6))]
        if ok:
            self.last[key] = (prompt, response)
        return ModelRequestRecorded(
            **self.envelope(run, rollout, attempt), call_id=f"c{self.count}", status="ok" if ok else "failed",
            prompt_ids=prompt, response_ids=response, logprobs=[-0.5 * i for i in range(len(response))],
            finish_reason="length" if self.rng.random() < 0.1 else "stop", response=HACK if hack else {},
            request={"messages": [{"role": "user", "content": f"step {self.count}"}]},
            usage={"prompt_tokens": len(prompt)}, error=None if ok else "upstream 500",
        )  # fmt: skip

    def build(self, op: tuple[Any, ...]) -> Event | bytes:
        kind = op[0]
        if kind == "run":
            if op[2] == 0:  # as written before schema version 5, a spec no RunSpec reads: recorded as it is
                return RunStarted(**self.envelope(op[1]), name=f"run {op[1]}", config={"k": op[2]})
            return RunStarted(
                **self.envelope(op[1]), name=f"run {op[1]}", spec=RunSpec(run_id=op[1], concurrency=op[2])
            )
        if kind == "created":
            return RolloutCreated(**self.envelope(op[1], op[2]), input={"task": op[3]}, group_id=f"g{op[3] % 2}")
        if kind == "status":
            return RolloutStatusChanged(**self.envelope(op[1], op[2], op[4]), status=op[3], reason=f"why {op[3]}")
        if kind == "attempt":
            return AttemptStarted(**self.envelope(op[1], op[2], op[3] or "a9"), sequence=op[4], executor="local")
        if kind == "call":
            return self.call(op[1], op[2], op[3], op[4], op[5], op[6])
        if kind == "reward":
            return RewardReported(**self.envelope(op[1], op[2], op[3]), value=op[4])
        if kind == "custom":
            payload: dict[str, Any] = {"k": op[4]} if op[4] != "nul" else {"k": "a\u0000b"}
            source: EventSource = "agent" if op[5] == AGENT_FLAG else "admin"  # an agent's "flag" is not a flag
            return CustomEvent(**self.envelope(op[1], op[2], op[3]), name=op[5], payload=payload, source=source)
        if kind == "model":
            if op[3]:
                return ModelRegistered(**self.envelope(op[1]), name=op[2], base_url=f"http://{op[2]}", api_key="sk")
            return ModelRemoved(**self.envelope(op[1]), name=op[2])
        if kind == "phase":
            return PhaseChanged(**self.envelope(op[1]), phase=op[2], weights_version=op[3])
        return POISON[op[1]]


def message(event: Event | bytes) -> tuple[str, bytes]:
    """(subject, data) of an event, or of a poison message."""
    if isinstance(event, bytes):
        return "rl.r0.rollout.x0.event.junk", event
    return event.subject, encode(event)


run_ = st.sampled_from(RUNS)
rollout_ = st.sampled_from(ROLLOUTS)
attempt_ = st.sampled_from(ATTEMPTS)
OPS = st.one_of(
    st.tuples(st.just("run"), run_, st.integers(0, 3)),
    st.tuples(st.just("created"), run_, rollout_, st.integers(0, 9)),
    st.tuples(st.just("created"), run_, rollout_, st.integers(0, 9)),
    st.tuples(st.just("status"), run_, rollout_, st.sampled_from(STATUSES), attempt_),
    st.tuples(st.just("status"), run_, rollout_, st.sampled_from(STATUSES), attempt_),
    st.tuples(st.just("attempt"), run_, rollout_, attempt_, st.integers(1, 3)),
    st.tuples(
        st.just("call"),
        run_,
        rollout_,
        attempt_,
        st.sampled_from(("extend", "extend", "retry", "fresh")),
        st.booleans() | st.just(True),
        st.booleans(),
    ),
    st.tuples(st.just("call"), run_, rollout_, attempt_, st.just("extend"), st.just(True), st.just(False)),
    st.tuples(st.just("reward"), run_, rollout_, attempt_, st.sampled_from((0.0, 0.5, 1.0))),
    st.tuples(
        st.just("custom"),
        run_,
        rollout_,
        attempt_,
        st.sampled_from(("a", "b", "nul")),
        st.sampled_from(("tool", "flag-hack", AGENT_FLAG)),
    ),
    st.tuples(st.just("model"), run_, st.sampled_from(("m0", "m1")), st.booleans()),
    st.tuples(st.just("phase"), run_, st.sampled_from(("rollout", "update")), st.integers(0, 3)),
    st.tuples(st.just("poison"), st.integers(0, len(POISON) - 1)),
)
# How messages reach the projector: batch size, how many already-applied ones are redelivered with
# it, and whether the batch is stored, lost in a crash before commit, followed by a restart, or
# stored together with the next one the pipelined way (folded ahead against its plan).
DELIVERY = st.tuples(
    st.integers(1, 9),
    st.integers(0, 4),
    st.sampled_from(("apply", "apply", "lost", "restart", "pipelined", "pipelined")),
)


def load_events(run: str, rollouts: int, seed: int) -> list[Event]:
    """A realistic run for load tests: each rollout created, started, 4 calls, a reward, an end."""
    builder = StreamBuilder(seed, prefix=f"{run}-")
    out: list[Event] = [RunStarted(**builder.envelope(run), name="load")]
    for index in range(rollouts):
        rid, aid = f"ro{index}", f"at{index}"
        out.append(RolloutCreated(**builder.envelope(run, rid), input={"i": index}, group_id=f"g{index // 4}"))
        out.append(RolloutStatusChanged(**builder.envelope(run, rid), status="queuing"))
        out.append(AttemptStarted(**builder.envelope(run, rid, aid), sequence=1))
        out.append(RolloutStatusChanged(**builder.envelope(run, rid, aid), status="running", previous="queuing"))
        for step in range(4):
            out.append(builder.call(run, rid, aid, "extend" if step else "fresh", True, step == 3 and index % 5 == 0))
        out.append(RewardReported(**builder.envelope(run, rid, aid), value=float(index % 2)))
        out.append(RolloutStatusChanged(**builder.envelope(run, rid, aid), status="succeeded", previous="running"))
    return out


def random_ops(rng: random.Random, count: int) -> list[tuple[Any, ...]]:
    """`count` random operations like `OPS` draws, without poison or values Postgres refuses."""
    out: list[tuple[Any, ...]] = []
    for _ in range(count):
        run, rollout, attempt = rng.choice(RUNS), rng.choice(ROLLOUTS), rng.choice(ATTEMPTS)
        kind = rng.choice(("run", "created", "created", "status", "status", "status", "attempt", "call", "call",
                           "reward", "custom", "model", "phase"))  # fmt: skip
        if kind == "run":
            out.append(("run", run, rng.randrange(3)))
        elif kind == "created":
            out.append(("created", run, rollout, rng.randrange(10)))
        elif kind == "status":
            out.append(("status", run, rollout, rng.choice(STATUSES), attempt))
        elif kind == "attempt":
            out.append(("attempt", run, rollout, attempt, rng.randrange(1, 4)))
        elif kind == "call":
            how = rng.choice(("extend", "retry", "fresh"))
            out.append(("call", run, rollout, attempt, how, rng.random() < 0.8, rng.random() < 0.2))
        elif kind == "reward":
            out.append(("reward", run, rollout, attempt, rng.choice((0.0, 1.0))))
        elif kind == "custom":
            out.append(("custom", run, rollout, attempt, "a", rng.choice(("tool", "flag-x", AGENT_FLAG))))
        elif kind == "model":
            out.append(("model", run, rng.choice(("m0", "m1")), rng.random() < 0.7))
        else:
            out.append(("phase", run, rng.choice(("rollout", "update")), rng.randrange(4)))
    return out
