"""The quickstart agent with a long tail of slow environments, for `bench_train_async.py`.

Each rollout waits before its first model call (environment setup) and inside each tool call
(tool execution). Every wait is `BENCH_FAST_S` seconds, or with probability `BENCH_SLOW_FRACTION`
`BENCH_SLOW_S` seconds, drawn from a generator seeded by the rollout id, so a rerun of the same
run sees the same tail. Run through the fork server: `python -m trainer.quickstart.forkserver
SOCKET slow_tool_agent` with `bench/` on PYTHONPATH.
"""

from __future__ import annotations

import os
import random
import time

from trainer.quickstart import agent
from trainer.quickstart.task import Task, run_tool

warmup = agent.warmup


def _waits() -> random.Random:
    return random.Random(f"{os.environ.get('ROLLWIRE_ROLLOUT_ID', '')}/slow-tool")


def _wait(rng: random.Random) -> None:
    slow = rng.random() < float(os.environ.get("BENCH_SLOW_FRACTION", "0.1"))
    time.sleep(float(os.environ.get("BENCH_SLOW_S" if slow else "BENCH_FAST_S", "8" if slow else "0.1")))


def main() -> None:
    """One rollout of the quickstart harness, with the waits of the module docstring."""
    rng = _waits()
    _wait(rng)

    def slow_tool(task: Task, name: str, arguments: str) -> str:
        _wait(rng)
        return run_tool(task, name, arguments)

    agent.main(tool=slow_tool)
