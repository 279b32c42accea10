"""What a local execution's directory says about it: ended (its supervisor's `result.json`),
running (its `lock` is held), never started, or lost with its supervisor.

The directory is the local backend's only record of an execution (see `local`), so these read
files and hold no state; `local_supervisor` writes what they read.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
from pathlib import Path
from typing import Any

from schemas import FailureCause
from services.controller.backends.base import ExecutionKey, ExecutionState
from services.controller.view import NOT_LAUNCHED

NOT_STARTED = NOT_LAUNCHED
"""Reason prefix of an execution whose supervisor never started (the launcher stopped first):
the controller does not count such an attempt against `max_attempts`."""

LOG_TAIL_LINES = 20
LOG_TAIL_CHARS = 2000


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log (at most `LOG_TAIL_CHARS`); "" when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16 * 1024))
            data = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    text = "\n".join(data.rstrip("\n").splitlines()[-lines:])
    return text[-LOG_TAIL_CHARS:]


def lock_held(path: Path) -> bool:
    """True when some process holds the flock on `path` (probing takes and drops it at once)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


def read_result(directory: Path) -> dict[str, Any] | None:
    """The supervisor's `result.json` (None: not there, or not readable yet)."""
    try:
        result = json.loads((directory / "result.json").read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def ended_state(key: ExecutionKey, directory: Path, result: dict[str, Any]) -> ExecutionState:
    """The state of an execution whose supervisor recorded `result`."""
    outcome = result.get("outcome")
    phase_name = result.get("phase", "agent")
    prefix = "" if phase_name in ("agent", "supervisor") else f"{phase_name}."
    if outcome == "succeeded":
        reason = None
        log_tail = None
    else:
        if outcome == "timeout":
            timeout = _spec_value(directory, "timeout_s")
            reason = f"timed out after {timeout:g}s; the {phase_name}'s process group was killed"
        else:
            reason = str(result.get("reason") or "the execution failed")
        log_tail = tail(directory / f"{prefix}stderr.log") or tail(directory / f"{prefix}stdout.log") or None
    return ExecutionState(
        key=key,
        phase="succeeded" if outcome == "succeeded" else "failed",
        reason=reason,
        cause=None if outcome == "succeeded" else local_cause(phase_name, outcome, result.get("exit_code")),
        exit_code=result.get("exit_code"),
        started_at=result.get("started_at"),
        finished_at=result.get("ended_at"),
        log_location=str(directory),
        log_tail=log_tail,
        execution=str(directory),
    )


def unended_state(key: ExecutionKey, directory: Path) -> ExecutionState | None:
    """The state of an execution with no result: running, never started, or its supervisor lost.
    None when its result was written meanwhile (read it again)."""
    location = str(directory)
    if lock_held(directory / "lock"):
        started = _mtime(directory / "supervisor.pid") or _mtime(directory / "spec.json")
        return ExecutionState(key=key, phase="running", started_at=started, log_location=location, execution=location)
    if not (directory / "supervisor.pid").exists():
        reason = f"{NOT_STARTED}the controller stopped before this execution's supervisor started"
        return ExecutionState(
            key=key,
            phase="failed",
            reason=reason,
            log_location=location,
            execution=location,
            cause="infrastructure",
        )
    if (directory / "result.json").exists():  # written between the two checks above
        return None
    return ExecutionState(
        key=key,
        phase="failed",
        reason="the execution's supervisor died without recording an exit status (killed by the OS or a person?)",
        cause="infrastructure",
        log_location=location,
        log_tail=tail(directory / "stderr.log") or None,
        execution=location,
    )


def local_cause(phase: str, outcome: str | None, exit_code: int | None) -> FailureCause:
    """A failed local execution's cause from the supervisor's structured result (never its log).

    Only the agent's own end can be the policy's doing: it ran past the time limit (`timeout`) or
    exited non-zero (`agent-error`). The evaluator's or the supervisor's failure, a cancellation, and
    a SIGKILL the controller did not send (the kernel's OOM killer; the controller's own kills end
    as `timeout` or `cancelled`) are `infrastructure`.
    """
    if phase != "agent" or outcome == "cancelled":
        return "infrastructure"
    if outcome == "timeout":
        return "timeout"
    if exit_code == -signal.SIGKILL:
        return "infrastructure"
    return "agent-error"


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _spec_value(directory: Path, name: str) -> float:
    try:
        return float(json.loads((directory / "spec.json").read_text()).get(name, 0.0))
    except (OSError, ValueError, TypeError):
        return 0.0
