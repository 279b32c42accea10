"""The supervisor of one local execution: runs the agent (then the evaluator) and records how it ended.

The local backend starts this file as a script (`python -I -S local_supervisor.py <execution dir>`),
standard library only, so it starts in milliseconds. It is the leader of its own session, so it
outlives a controller that crashes or restarts; the next controller finds it again by its
execution directory. Inside that directory:

    spec.json        what to run (written by the backend before the start)
    lock             flock-ed for the supervisor's whole life (inherited from the backend at the
                     start): held = alive; released with no result.json = died unrecorded
    supervisor.pid   this process (the leader of its process group)
    agent.pid        the running phase's process group
    stdout.log, stderr.log                     the agent's output
    evaluator.stdout.log, evaluator.stderr.log the evaluator's output
    result.json      how it ended (written atomically, last)
    workspace/       the working directory of the agent and the evaluator

Each phase runs in a process group of its own; on timeout or cancellation (SIGTERM to the
supervisor) that whole group gets SIGTERM, then SIGKILL after the grace period, and after a
phase ends normally its group is killed too, so nothing the agent left behind keeps running.
The deadline is absolute (in spec.json), so it holds even while no controller is running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_cancel_requested = False


def _on_cancel(signum: int, frame: object) -> None:
    global _cancel_requested
    _cancel_requested = True


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM the phase's process group, then SIGKILL it after `grace_s`; returns the exit status."""
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGKILL)
        return proc.wait()
    _kill_group(proc.pid, signal.SIGKILL)  # members that outlived the leader or ignored SIGTERM
    return code


def _describe_exit(phase: str, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{phase} was killed by {name}"
    return f"{phase} exited with code {code}"


def isolated(command: list[str], isolation: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The command line and extra `Popen` arguments that run `command` isolated as the backend chose.

    `user`: under the execution's own uid and gid, no supplementary groups; `namespace`: inside
    the sandbox (`local_sandbox.py`), which hides the data dir; anything else: as it is.
    """
    mode = isolation.get("mode")
    if mode == "user":
        return command, {"user": int(isolation["uid"]), "group": int(isolation["gid"]), "extra_groups": []}
    if mode == "namespace":
        config = {k: isolation[k] for k in ("hide", "keep", "cwd")}
        return [sys.executable, "-I", "-S", str(isolation["sandbox"]), json.dumps(config), *command], {}
    return command, {}


def run_phase(
    directory: Path,
    phase: str,
    command: list[str],
    env: dict[str, str],
    deadline: float,
    grace_s: float,
    isolation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one phase (agent or evaluator) to its end, its deadline or a cancellation."""
    prefix = "" if phase == "agent" else f"{phase}."
    command, extra = isolated(command, isolation or {})
    with (
        open(directory / f"{prefix}stdout.log", "ab") as out,
        open(directory / f"{prefix}stderr.log", "ab") as err,
    ):
        try:
            proc = subprocess.Popen(
                command,
                cwd=directory / "workspace",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                process_group=0,
                **extra,
            )
        except OSError as exc:
            return {
                "outcome": "failed",
                "phase": phase,
                "exit_code": None,
                "reason": f"cannot start the {phase}: {exc}",
            }
    (directory / "agent.pid").write_text(str(proc.pid))
    while True:
        if _cancel_requested:
            code = _stop(proc, grace_s)
            return {"outcome": "cancelled", "phase": phase, "exit_code": code, "reason": f"{phase} was cancelled"}
        remaining = deadline - time.time()
        if remaining <= 0:
            code = _stop(proc, grace_s)
            return {"outcome": "timeout", "phase": phase, "exit_code": code, "reason": "timed out"}
        try:
            code = proc.wait(min(remaining, 0.25))
        except subprocess.TimeoutExpired:
            continue
        _kill_group(proc.pid, signal.SIGKILL)  # whatever the phase left running in its group
        outcome = "succeeded" if code == 0 else "failed"
        return {"outcome": outcome, "phase": phase, "exit_code": code, "reason": _describe_exit(phase, code)}


def supervise(directory: Path) -> dict[str, Any]:
    """Run the execution described by `directory/spec.json` and return its result record."""
    spec = json.loads((directory / "spec.json").read_text())
    started = time.time()
    deadline = float(spec["deadline"])
    grace_s = float(spec.get("kill_grace_s", 5.0))
    isolation = spec.get("isolation") or {}
    result = run_phase(directory, "agent", spec["command"], spec["env"], deadline, grace_s, isolation)
    if result["outcome"] == "succeeded" and spec.get("evaluator_command"):
        env = dict(spec["evaluator_env"])
        env["ROLLWIRE_AGENT_EXIT_CODE"] = str(result["exit_code"])
        result = run_phase(directory, "evaluator", spec["evaluator_command"], env, deadline, grace_s, isolation)
    result["started_at"] = started
    result["ended_at"] = time.time()
    return result


def main(argv: list[str]) -> int:
    """Entry point: `local_supervisor.py <execution dir>`."""
    directory = Path(argv[1])
    os.umask(0o077)  # its logs and records are the operator's, not the agents'
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_cancel)
    (directory / "supervisor.pid").write_text(str(os.getpid()))
    try:
        result = supervise(directory)
    except Exception as exc:  # a broken spec must still end with a result, never a silent death
        result = {"outcome": "failed", "phase": "supervisor", "exit_code": None, "reason": f"supervisor error: {exc!r}"}
        result["ended_at"] = time.time()
    tmp = directory / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, directory / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
