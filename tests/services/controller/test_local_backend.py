"""The local backend against real processes: launch, logs, exit status, timeout, cancel, takeover."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.controller.backends.base import ExecutionKey, ExecutionState, LaunchSpec, PermanentBackendError
from services.controller.backends.local import LocalBackend
from services.controller.backends.local_state import NOT_STARTED

PY = sys.executable


def key(n: int = 1) -> ExecutionKey:
    return ExecutionKey("run1", f"ro{n}", f"at{n}")


def spec(
    k: ExecutionKey, code: str, *, timeout_s: float = 30.0, env: dict[str, str] | None = None, **kw: object
) -> LaunchSpec:
    return LaunchSpec(
        key=k,
        env={"ROLLWIRE_TOKEN": "agent-token", **(env or {})},
        input_json=json.dumps({"q": "2+2"}),
        timeout_s=timeout_s,
        command=[PY, "-c", code],
        **kw,  # type: ignore[arg-type]
    )


async def until(
    backend: LocalBackend, k: ExecutionKey, *, terminal: bool = True, timeout: float = 20.0
) -> ExecutionState:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for state in await backend.list():
            if state.key == k and (state.terminal or not terminal):
                return state
        await asyncio.sleep(0.05)
    raise AssertionError(f"{k} did not get there in {timeout}s")


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    b = LocalBackend(tmp_path / "executions", kill_grace_s=1.0, poll_s=0.1)
    try:
        yield b
    finally:
        await b.close()


def alive(pgid: int) -> bool:
    """True while a process of group `pgid` runs (zombies waiting for init to reap them do not count)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def running(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_agent_gets_its_input_and_env_and_logs_are_kept(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLWIRE_ADMIN_TOKEN", "admin-secret")
    code = (
        "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if 'ROLLWIRE' in k or k == 'PWD'}));"
        "print(os.getcwd()); assert json.load(open(os.environ['ROLLWIRE_INPUT_FILE'])) == {'q': '2+2'}"
    )
    k = key()
    await backend.launch(spec(k, code))
    state = await until(backend, k)
    assert state.phase == "succeeded", state
    assert state.exit_code == 0 and state.log_location
    directory = Path(state.log_location)
    lines = (directory / "stdout.log").read_text().splitlines()
    env = json.loads(lines[0])
    assert json.loads(env["ROLLWIRE_INPUT"]) == {"q": "2+2"}
    assert env["ROLLWIRE_TOKEN"] == "agent-token"
    assert "ROLLWIRE_ADMIN_TOKEN" not in env  # never leaked to an untrusted agent
    assert lines[1] == str(directory / "workspace")


async def test_failure_reports_exit_code_and_last_log_lines(backend: LocalBackend) -> None:
    k = key()
    await backend.launch(
        spec(
            k, "import sys; print('line one', file=sys.stderr); print('Traceback: boom', file=sys.stderr); sys.exit(3)"
        )
    )
    state = await until(backend, k)
    assert state.phase == "failed" and state.exit_code == 3
    assert state.reason == "agent exited with code 3"
    assert state.log_tail is not None and "Traceback: boom" in state.log_tail


async def test_missing_command_is_named(backend: LocalBackend) -> None:
    k = key()
    await backend.launch(LaunchSpec(key=k, env={}, input_json="null", timeout_s=5, command=["/nonexistent/agent"]))
    state = await until(backend, k)
    assert state.phase == "failed" and "cannot start the agent" in (state.reason or "")
    with pytest.raises(PermanentBackendError, match=r"RunSpec\.command"):
        await backend.launch(LaunchSpec(key=key(2), env={}, input_json="null", timeout_s=5))


async def test_timeout_kills_the_whole_process_group(backend: LocalBackend, tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(marker)!r}, 'w').write(str(p.pid));"
        "time.sleep(60)"
    )
    k = key()
    started = time.monotonic()
    await backend.launch(spec(k, code, timeout_s=1.5))
    state = await until(backend, k)
    assert state.phase == "failed" and (state.reason or "").startswith("timed out after 1.5s")
    assert time.monotonic() - started < 8
    agent_pgid = int((Path(state.log_location or "") / "agent.pid").read_text())
    child = int(marker.read_text())
    await asyncio.sleep(0.2)
    assert not alive(agent_pgid)
    assert not running(child)  # the agent's child was in its group


async def test_cancel_stops_the_group_and_keeps_logs(backend: LocalBackend) -> None:
    k = key()
    events: list[ExecutionState] = []

    async def follow() -> None:
        async for state in backend.watch():
            events.append(state)

    watcher = asyncio.create_task(follow())
    await backend.launch(spec(k, "import time; print('working', flush=True); time.sleep(60)"))
    state = await until(backend, k, terminal=False)
    assert state.phase == "running"
    directory = Path(state.log_location or "")
    while not (directory / "agent.pid").exists():
        await asyncio.sleep(0.02)
    pgid = int((directory / "agent.pid").read_text())
    await backend.cancel(k)
    assert not alive(pgid)
    assert await backend.list() == []
    assert (directory / "stdout.log").exists()
    await asyncio.sleep(0.3)
    watcher.cancel()
    assert events[-1].deleted and events[-1].key == k and events[-1].phase == "failed"
    await backend.cancel(k)  # unknown now: a no-op


async def test_launch_is_idempotent(backend: LocalBackend, tmp_path: Path) -> None:
    counter = tmp_path / "starts"
    k = key()
    s = spec(k, f"open({str(counter)!r}, 'a').write('x')")
    await asyncio.gather(backend.launch(s), backend.launch(s))
    await until(backend, k)
    await backend.launch(s)
    await asyncio.sleep(0.3)
    assert counter.read_text() == "x"


async def test_a_new_backend_takes_over_running_executions(tmp_path: Path) -> None:
    root = tmp_path / "executions"
    first = LocalBackend(root, poll_s=0.1)
    k = key()
    await first.launch(spec(k, "import time; time.sleep(1.0)"))
    await first.close()  # the controller goes away; the execution keeps running
    second = LocalBackend(root, poll_s=0.1)
    try:
        seen: list[ExecutionState] = []
        async for state in second.watch():
            seen.append(state)
            if state.terminal:
                break
        assert seen[0].phase == "running" and seen[-1].phase == "succeeded"
    finally:
        await second.close()


def _half_launched(backend: LocalBackend, k: ExecutionKey) -> None:
    """What a launcher that died between indexing and forking leaves behind."""
    directory = backend.directory(k)
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    os.symlink(os.path.relpath(directory, backend.root / "active"), backend._index(k))


async def test_execution_whose_supervisor_never_started_is_reported_and_can_be_started(backend: LocalBackend) -> None:
    k = key()
    _half_launched(backend, k)
    (state,) = await backend.list()
    assert state.phase == "failed" and (state.reason or "").startswith(NOT_STARTED)
    await backend.launch(spec(k, "pass"))
    assert (await until(backend, k)).phase == "succeeded"


async def test_evaluator_runs_after_agent_with_its_own_token(backend: LocalBackend) -> None:
    k = key()
    evaluator = [
        PY,
        "-c",
        "import os, sys; print(os.environ['ROLLWIRE_TOKEN'], os.environ['ROLLWIRE_AGENT_EXIT_CODE']);"
        "sys.exit(0 if os.path.exists('answer') else 4)",
    ]
    await backend.launch(
        spec(
            k,
            "open('answer', 'w').write('4')",
            evaluator_command=evaluator,
            evaluator_env={"ROLLWIRE_TOKEN": "eval-token"},
        )
    )
    state = await until(backend, k)
    assert state.phase == "succeeded", state
    assert (Path(state.log_location or "") / "evaluator.stdout.log").read_text().split() == ["eval-token", "0"]
    k2 = key(2)
    await backend.launch(spec(k2, "pass", evaluator_command=evaluator, evaluator_env={"ROLLWIRE_TOKEN": "eval-token"}))
    failed = await until(backend, k2)
    assert failed.phase == "failed" and failed.reason == "evaluator exited with code 4"
