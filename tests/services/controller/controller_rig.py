"""End-to-end rig of the controller: a gateway, a fake vLLM upstream and controllers as real processes.

The gateway (`python -m services.gateway`) and the fake upstream (`tests/services/gateway/fake_vllm.py`)
are shared by the session; each test gets its own run id and starts its own controllers
(`python -m services.controller --run <its run>`), so it can kill and restart them freely.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.devstack.embedded import free_port

REPO = Path(__file__).resolve().parents[3]
AGENTS = REPO / "examples" / "agents"
FAKE_VLLM = REPO / "tests" / "services" / "gateway" / "fake_vllm.py"
ADMIN = "controller-tests-admin-token"
SECRET = "controller-tests-signing-secret"
TERMINAL = ("succeeded", "failed", "cancelled")


class Child:
    """A child process with its output in a log file (shown when a test fails)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log_path = log
        self._log = open(log, "ab")  # closed in stop()
        self.proc = subprocess.Popen(
            args, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )

    def log(self) -> str:
        """The child's output so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal the child and wait for it; SIGKILL its group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def _wait_http(url: str, child: Child, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{child.name} did not answer at {url}:\n{child.log()}")


def base_env(**extra: str) -> dict[str, str]:
    """The environment of the rig's children."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWIRE_")}
    env.update(PYTHONUNBUFFERED="1", ROLLWIRE_ADMIN_TOKEN=ADMIN, ROLLWIRE_SECRET=SECRET, **extra)
    return env


@pytest.fixture(scope="session")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL (…/v1) of a fake vLLM server."""
    port = free_port()
    log = tmp_path_factory.mktemp("upstream") / "fake_vllm.log"
    child = Child("fake vLLM", [sys.executable, str(FAKE_VLLM), "--port", str(port)], base_env(), log)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", child)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        child.stop()


@pytest.fixture(scope="session")
def gateway_url(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a gateway process on the session's NATS."""
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    args = [sys.executable, "-m", "services.gateway", "--port", str(port), "--nats-url", nats_url]
    child = Child("gateway", args, base_env(), log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/healthz", child)
        yield url
    finally:
        child.stop()


class Rig:
    """One test's run: create it, its rollouts and its controllers; read back what happened."""

    def __init__(self, gateway_url: str, nats_url: str, upstream: str, run_id: str, tmp: Path) -> None:
        self.gateway_url = gateway_url
        self.nats_url = nats_url
        self.upstream = upstream
        self.run_id = run_id
        self.tmp = tmp
        self.executions = tmp / "executions"
        self.admin = httpx.Client(base_url=gateway_url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
        self.controllers: list[Child] = []

    def start_run(self, **spec: Any) -> None:
        """Declare the run (how its rollouts execute) and register the fake model for it."""
        r = self.admin.post("/api/runs", json={"run_id": self.run_id, **spec})
        assert r.status_code in (200, 201), r.text
        r = self.admin.post("/api/models", json={"name": "fake", "base_url": self.upstream, "run_id": self.run_id})
        assert r.status_code == 201, r.text

    def create(self, *inputs: Any, **fields: Any) -> list[str]:
        """Create rollouts with these inputs; returns their ids."""
        body = {"rollouts": [{"run_id": self.run_id, "input": value, **fields} for value in inputs]}
        r = self.admin.post("/api/rollouts", json=body)
        assert r.status_code == 201, r.text
        return [item["rollout_id"] for item in r.json()["rollouts"]]

    def start_controller(self, *extra: str) -> Child:
        """A controller serving only this run, with its own durable consumer and executions directory."""
        args = [
            sys.executable,
            "-m",
            "services.controller",
            "--gateway-url",
            self.gateway_url,
            "--nats-url",
            self.nats_url,
            "--run",
            self.run_id,
            "--durable",
            f"controller-{self.run_id}",
            "--executions-dir",
            str(self.executions),
            "--resync-s",
            "1",
            *extra,
        ]
        log = self.tmp / f"controller-{len(self.controllers)}.log"
        child = Child("controller", args, base_env(), log)
        self.controllers.append(child)
        return child

    def rollout(self, rollout_id: str) -> dict[str, Any]:
        """The rollout as the gateway reports it."""
        r = self.admin.get(f"/api/rollouts/{rollout_id}")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def wait(self, rollout_id: str, statuses: tuple[str, ...] = TERMINAL, timeout: float = 30.0) -> dict[str, Any]:
        """Poll the rollout until its status is one of `statuses`."""
        deadline = time.monotonic() + timeout
        rollout: dict[str, Any] = {}
        while time.monotonic() < deadline:
            rollout = self.rollout(rollout_id)
            if rollout["state"] in statuses:
                return rollout
            time.sleep(0.05)
        logs = "\n".join(c.log()[-4000:] for c in self.controllers)
        raise AssertionError(f"rollout {rollout_id} stayed {rollout.get('state')}; controller logs:\n{logs}")

    def events(self, rollout_id: str, kind: str) -> list[dict[str, Any]]:
        """The rollout's events of one type (reward, custom, model_request, ...)."""
        r = self.admin.get(f"/api/rollouts/{rollout_id}/events", params={"type": kind})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def close(self) -> None:
        for child in self.controllers:
            child.stop()
        self.admin.close()


@pytest.fixture
def rig(gateway_url: str, nats_url: str, upstream: str, run_id: str, tmp_path: Path) -> Iterator[Rig]:
    """This test's run on the shared gateway."""
    r = Rig(gateway_url, nats_url, upstream, run_id, tmp_path)
    try:
        yield r
    finally:
        r.close()


def agent(name: str) -> list[str]:
    """The command of an example agent."""
    return [sys.executable, str(AGENTS / name)]
