"""Through `rollwire up`: a queued rollout runs a real Python agent (the `openai` client against the proxy),
reports a reward, and ends succeeded.

The stack uses the session's NATS and Postgres (`--external`) and starts the gateway, the
projector (the gateway's reads come from its Postgres tables) and the controller; the model
behind the proxy is the fake vLLM server, registered for the test's run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from controller_rig import agent


def test_rollwire_up_runs_a_real_openai_agent_to_success(
    nats_url: str, pg_url: str, upstream: str, run_id: str, tmp_path: Path
) -> None:
    data = tmp_path / "stack"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWIRE_")}
    env.update(NATS_URL=nats_url, DATABASE_URL=pg_url)
    up = [
        sys.executable,
        "-m",
        "services.devstack.cli",
        "up",
        "--data-dir",
        str(data),
        "--external",
        "--gateway-port",
        "0",
    ]
    up += ["--services", "gateway,projector,controller"]
    proc = subprocess.Popen(up, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        endpoints: dict[str, str] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "ready":
                break
            key, _, value = line.strip().partition(": ")
            endpoints[key] = value
        token = (data / "admin_token").read_text().strip()
        admin = httpx.Client(base_url=endpoints["gateway"], headers={"authorization": f"Bearer {token}"}, timeout=30)
        r = admin.post("/api/runs", json={"run_id": run_id, "command": agent("openai_agent.py"), "timeout_s": 60})
        assert r.status_code == 201, r.text
        r = admin.post("/api/models", json={"name": "fake", "base_url": upstream, "run_id": run_id})
        assert r.status_code == 201, r.text
        task = {"question": "What is 2+2?", "answer": "4"}
        r = admin.post("/api/rollouts", json={"rollouts": [{"run_id": run_id, "input": task}]})
        rid = r.json()["rollouts"][0]["rollout_id"]
        deadline = time.monotonic() + 60
        rollout: dict[str, Any] = {}
        while rollout.get("state") not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, f"rollout stayed {rollout.get('state')}; logs in {data / 'logs'}"
            time.sleep(0.05)
            response = admin.get(f"/api/rollouts/{rid}")  # the projection may lag a moment behind the stream
            rollout = response.json() if response.status_code == 200 else {}
        assert rollout["state"] == "succeeded" and rollout["attempt_count"] == 1, rollout

        def events(kind: str) -> list[dict[str, Any]]:
            return admin.get(f"/api/rollouts/{rid}/events", params={"type": kind}).json()  # type: ignore[no-any-return]

        (reward,) = events("reward")
        assert reward["value"] in (0.0, 1.0) and reward["source"] == "agent"
        (call,) = events("model_request")  # the agent's call crossed the proxy; its tokens are recorded
        assert call["response_ids"] and len(call["logprobs"]) == len(call["response_ids"])
        custom = {e["name"]: e for e in events("custom")}
        assert "text" in custom["answer"]["payload"]
        logs = Path(custom["log"]["payload"]["log_location"])  # the execution's logs, linked from the rollout
        assert logs.is_relative_to(data / "executions") and "reply=" in (logs / "stdout.log").read_text()
        admin.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
