"""The evaluator side shared by the examples: score the agent's `result.json`, report with the evaluator token.

The controller runs an example's evaluator after the agent exited 0, in the agent's workspace,
with its own token (`ROLLWIRE_TOKEN`); with `reward_from = "evaluator"` in the run, its reward is
the only one that counts, so an agent cannot award itself. Each example supplies
`evaluate(task, result) -> (reward, metrics)`; the metrics go out as the `metrics` custom event
that the trainer averages per step (`agent_<name>` columns of `metrics.csv`), and the reward with
what the agent left goes out as the `evaluation` event (long strings cut), for audit and tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services import agentkit

RESULT_FILE = "result.json"
Evaluate = Callable[[dict[str, Any], dict[str, Any]], tuple[float, dict[str, float]]]


def read_result(path: Path = Path(RESULT_FILE)) -> dict[str, Any]:
    """What the agent left (an empty result when it left nothing readable)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def bounded(value: Any, limit: int = 2000) -> Any:
    """The agent's result with long strings cut, so an event stays small whatever the agent wrote."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, dict):
        return {str(k)[:100]: bounded(v, limit) for k, v in list(value.items())[:50]}
    if isinstance(value, list):
        return [bounded(v, limit) for v in value[:50]]
    return value


def evaluator_main(evaluate: Evaluate) -> None:
    """Score this attempt's workspace and report the reward and the metrics."""
    attempt = agentkit.current()
    task = attempt.read_input()
    result = read_result()
    reward, metrics = evaluate(task, result)
    print(f"reward={reward} metrics={metrics}")
    attempt.emit("metrics", metrics)
    attempt.emit("evaluation", {"reward": reward, "result": bounded(result)})
    attempt.report_reward(reward, name="evaluator")
