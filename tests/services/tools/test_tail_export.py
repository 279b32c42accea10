"""`rollwire tail` (exactly the matching events, in order), `rollwire export` round trips, `rollwire runs`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from agentrun import agent_run
from replay_support import CliResult, publish

from schemas import (
    CustomEvent,
    ModelRegistered,
    ModelRequestRecorded,
    PhaseChanged,
    RewardReported,
    RolloutStatusChanged,
    decode,
    encode,
)
from schemas.refs import CallRef, pack
from services.common.eventstore import StoredEvent
from services.tools.export import read_export
from services.tools.tail import BadTime, parse_since, pretty

Rollwire = Callable[..., CliResult]


class Tail:
    """A running `rollwire tail` whose output lines the test reads one at a time."""

    def __init__(self, nats_url: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.devstack.cli", "tail", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "NATS_URL": nats_url, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip

    def lines(self, n: int, timeout: float = 20.0) -> list[str]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        got: list[str] = []
        while len(got) < n:
            assert time.monotonic() < deadline, f"only {got} within {timeout}s"
            line = self.proc.stdout.readline()
            assert line, f"tail exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
            got.append(line.rstrip("\n"))
        return got

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def tail(nats_url: str) -> Iterator[Callable[..., Tail]]:
    started: list[Tail] = []

    def start(*args: str) -> Tail:
        started.append(Tail(nats_url, *args))
        return started[-1]

    yield start
    for t in started:
        t.stop()


def test_tail_prints_exactly_the_matching_events_in_order(
    tail: Callable[..., Tail], nats_url: str, run_id: str
) -> None:
    rewards = [RewardReported(run_id=run_id, rollout_id=f"r{i % 3}", value=i / 10) for i in range(6)]
    noise = [
        RolloutStatusChanged(run_id=run_id, rollout_id="r0", status="queuing"),
        CustomEvent(run_id=run_id, rollout_id="r1", name="reward", payload={"not": "a reward"}),
        RewardReported(run_id=f"{run_id}x", rollout_id="r0", value=9.0),  # another run
    ]
    mixed = [rewards[0], noise[0], rewards[1], rewards[2], noise[1], rewards[3], noise[2], rewards[4], rewards[5]]
    publish(nats_url, mixed)
    t = tail(f"rl.{run_id}.rollout.*.reward", "--from-start", "--format", "json")
    got = [decode(line) for line in t.lines(6)]
    assert got == rewards
    # Live: the next line is the next matching event, nothing in between.
    later = RewardReported(run_id=run_id, rollout_id="r9", value=1.0)
    publish(nats_url, [RolloutStatusChanged(run_id=run_id, rollout_id="r9", status="queuing"), later])
    assert [decode(line) for line in t.lines(1)] == [later]


def test_tail_since_a_time_and_the_pretty_format(tail: Callable[..., Tail], nats_url: str, run_id: str) -> None:
    publish(nats_url, [RewardReported(run_id=run_id, rollout_id="old", value=0.0)])
    time.sleep(1.1)
    since = time.time()
    call = ModelRequestRecorded(
        run_id=run_id, rollout_id="new", attempt_id="a1", call_id="c" * 40, prompt_ids=[1] * 300,
        response_ids=[2] * 20, logprobs=[-0.1] * 20, model="policy", weights_version=3, finish_reason="tool_calls",
        response={"message": {"content": "I will look at the tests first " * 10, "tool_calls": [
            {"function": {"name": "bash", "arguments": '{"command": "pytest -q"}'}}]}},
    )  # fmt: skip
    publish(nats_url, [call])
    (line,) = tail(f"rl.{run_id}.>", "--since", f"{since:.3f}").lines(1)
    assert f"{run_id[:13]}…/new model_request call=ccccccccc… ok model=policy v=3 tokens=300+20" in line
    assert "finish=tool_calls 'I will look at the tests first I will look at the tests fir…'" in line
    assert 'tools: bash({"command": "pytest -q"})' in line
    assert "old" not in line


def test_tail_prints_a_packed_call_as_stored_and_counts_its_tokens(
    tail: Callable[..., Tail], nats_url: str, run_id: str
) -> None:
    first = ModelRequestRecorded(run_id=run_id, rollout_id="p", attempt_id="a1", call_id="c1",
                                 packed=pack([5] * 30, [6] * 4, [-0.5] * 4))  # fmt: skip
    second = ModelRequestRecorded(
        run_id=run_id, rollout_id="p", attempt_id="a1", call_id="c2", packed=pack([7] * 3, [8] * 2, [-0.25] * 2),
        prompt_ref=CallRef(event_id=first.event_id, tokens=34),
    )  # fmt: skip
    publish(nats_url, [first, second])
    as_json = tail(f"rl.{run_id}.>", "--from-start", "--format", "json").lines(2)
    assert [json.loads(line)["packed"] for line in as_json] == [
        json.loads(encode(e))["packed"] for e in (first, second)
    ]
    assert [decode(line, unpack=False) for line in as_json] == [first, second]
    pretty_lines = tail(f"rl.{run_id}.>", "--from-start").lines(2)
    assert "tokens=30+4" in pretty_lines[0] and "tokens=37+2" in pretty_lines[1]


def test_pretty_lines_have_the_key_fields() -> None:
    def show(event: object) -> str:
        return pretty(StoredEvent(seq=1, subject="s", event=event))  # type: ignore[arg-type]

    status = RolloutStatusChanged(run_id="r", rollout_id="x", attempt_id="a1", status="failed", previous="running",
                                  reason="agent exited with code 3\nTraceback ...")  # fmt: skip
    expected = "r/x rollout.status running → failed attempt=a1 reason='agent exited with code 3 Traceback ...'"
    assert show(status).endswith(expected)
    assert show(PhaseChanged(run_id="r", phase="update", weights_version=4)).endswith("r phase update v=4")
    assert show(ModelRegistered(run_id="r", name="policy", base_url="http://e:8000/v1", api_key="sk-secret")).endswith(
        "r model.registered policy http://e:8000/v1 v=-"
    )
    flag = CustomEvent(run_id="r", rollout_id="x", name="flag", payload={"rule": "reads-git-history"})
    assert show(flag).endswith('r/x custom flag {"rule":"reads-git-history"}')


def test_since_accepts_durations_iso_times_and_unix_seconds() -> None:
    now = 1_800_000_000.0
    assert parse_since("90s", now) == now - 90
    assert parse_since("15m", now) == now - 900
    assert parse_since("2h", now) == now - 7200
    assert parse_since("1d", now) == now - 86400
    assert parse_since("2027-01-15T08:00:00Z") == datetime(2027, 1, 15, 8, tzinfo=UTC).timestamp()
    assert parse_since("2027-01-15T09:00:00+01:00") == datetime(2027, 1, 15, 8, tzinfo=UTC).timestamp()
    assert parse_since("1800000000.5") == 1_800_000_000.5
    with pytest.raises(BadTime, match="give a duration"):
        parse_since("yesterday")


def test_tail_rejects_contradicting_options(rollwire: Rollwire) -> None:
    result = rollwire("tail", "rl.>", "--from-start", "--since", "5m")
    assert result.exit_code == 2 and result.stderr == "error: --from-start and --since exclude each other; give one\n"
    assert rollwire("tail", "rl.>", "--since", "soon").stderr.startswith("error: --since 'soon' is not a time")


# ---- export and runs --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_round_trips(rollwire: Rollwire, nats_url: str, run_id: str, tmp_path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    events = agent_run(run_id, groups=2, per_group=2, seed=6)
    events.append(ModelRegistered(run_id=run_id, name="policy", base_url="http://e/v1", api_key="sk-secret"))
    publish(nats_url, events)
    out = tmp_path / f"run.{fmt}"
    result = rollwire("export", run_id, "--format", fmt, "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert result.stderr == f"exported {len(events)} events of run {run_id} to {out}\n"
    back = list(read_export(out))
    assert back[:-1] == events[:-1]  # every event, every field, in stream order
    assert back[-1] == msgspec.structs.replace(events[-1], api_key=None)  # secrets are never exported
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(out, columns=["seq", "type", "rollout_id", "prompt_ids", "logprobs", "value"])
        rows = table.to_pylist()
        assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
        call = next(r for r in rows if r["type"] == "model_request")
        assert isinstance(call["prompt_ids"], list) and isinstance(call["logprobs"][0], float)


def test_export_to_stdout_and_a_missing_run(rollwire: Rollwire, nats_url: str, run_id: str) -> None:
    events = [RewardReported(run_id=run_id, rollout_id="x", value=float(i)) for i in range(3)]
    publish(nats_url, events)
    result = rollwire("export", run_id, "--out", "-")
    assert [decode(line) for line in result.stdout.splitlines()] == events
    missing = rollwire("export", "no-such-run")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: run 'no-such-run' has no events")


def test_runs_lists_runs_with_their_sizes(rollwire: Rollwire, nats_url: str, run_id: str) -> None:
    events = agent_run(run_id, groups=2, per_group=3, seed=8)
    publish(nats_url, events)
    result = rollwire("runs")
    assert result.exit_code == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["run", "name", "rollouts", "events", "bytes", "last", "event"]
    (row,) = [r.split() for r in rows if r.startswith(run_id + " ")]
    rollouts = len({e.rollout_id for e in events})
    size = sum(len(msgspec.json.encode(e)) for e in events)
    assert row[2:4] == [str(rollouts), str(len(events))]
    assert row[4:6] == [f"{size / 1000:.1f}", "KB"]
    assert rows[-1].startswith("total")
    assert json.dumps(row)  # one plain line per run
