"""A hostile agent launched by the controller of a real `rollwire up` cannot get out; its legitimate path works.

The agent (`escape_agent.py`) is told the data dir and every server's address, then tries: the
admin token, `endpoints.json` and the credentials file (by path and by walking up from its
workspace), its environment, other processes' environments and root links under /proc, a
forged reward of 1000 published straight onto NATS without and with guessed credentials, a
Postgres login, and the engine's (vLLM's) weight-reload and generation routes. Then it makes one
proxy call and reports a reward of 0.5 through its token, as any agent does.

Measured on the tree before isolation (data dir readable, NATS and Postgres open, agents as the
stack's user, an engine without a key): admin token, endpoints.json, /proc (a service's
environment), NATS without and with guessed credentials, Postgres and the engine's two routes
ESCAPED: 8 of 10. Now none: the stack's vLLM requires the stack's key on every route but
`GET /health`, and the agent never sees that key.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ops_stack import Stack

AGENT = Path(__file__).with_name("escape_agent.py")
ATTEMPTS = 11
"""What the agent reports: ten ways out and the legitimate path."""


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def _report(stack: Stack, run_id: str) -> dict[str, str]:
    """The JSON line the agent printed, from its execution's stdout log (the operator may read it)."""
    logs = list((stack.data_dir / "executions" / "runs" / run_id).glob("*/*/stdout.log"))
    assert logs, f"no execution of {run_id} under {stack.data_dir}"
    lines = [line for line in logs[0].read_text().splitlines() if line.startswith("{")]
    assert lines, (logs[0].read_text(), logs[0].with_name("stderr.log").read_text()[-3000:])
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _wait(stack: Stack, rid: str, timeout: float = 600) -> dict[str, Any]:
    with stack.admin() as admin:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rollout: dict[str, Any] = admin.get(f"/api/rollouts/{rid}").json()
            if rollout.get("state") in ("succeeded", "failed", "cancelled"):
                return rollout
            time.sleep(0.2)
    raise AssertionError(f"rollout {rid} did not end within {timeout}s")


def test_a_hostile_local_agent_reaches_no_secret_and_no_server(stack: Stack) -> None:
    """The stack the other ops tests share (agent isolation `auto`, the default engine, vLLM)."""
    run_id = "escape"
    task = {
        "data_dir": str(stack.data_dir),
        "nats_port": _port(stack.endpoints["nats"]),
        "pg_port": _port(stack.endpoints["postgres"]),
        "engine_url": stack.endpoints["engine"],
    }
    with stack.admin() as admin:
        spec = {"run_id": run_id, "command": [sys.executable, str(AGENT)], "timeout_s": 450, "max_attempts": 1}
        assert admin.post("/api/runs", json=spec).status_code in (200, 201)
        created = admin.post("/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": task}]})
        assert created.status_code == 201, created.text
        rid = created.json()["rollouts"][0]["rollout_id"]
    rollout = _wait(stack, rid)
    report = _report(stack, run_id)
    print(json.dumps(report, indent=2))
    assert rollout["state"] == "succeeded", (rollout, report)
    assert report["legit"].startswith("ok") and "reward 20" in report["legit"], report
    escaped = {name: what for name, what in report.items() if what.startswith("ESCAPED")}
    assert not escaped, escaped
    assert len(report) == ATTEMPTS, report  # every attempt ran
    for route in ("engine weights reload", "engine unrecorded generation"):  # vLLM's key, not a lost connection
        assert report[route] == "refused (401)", report
    with stack.admin() as admin:
        rewards = admin.get(f"/api/rollouts/{rid}").json()
    assert "1000" not in json.dumps(rewards.get("rewards", rewards.get("reward", ""))), rewards
