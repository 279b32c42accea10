"""How the local backend keeps an agent away from the stack's secrets: the isolation modes.

An agent holds only its attempt token; everything else in the data dir (admin token, signing
key, NATS and Postgres credentials, logs, other executions) must be out of its reach. Which
mechanism does that depends on who runs the stack:

- `user` (the controller runs as root): each execution runs under a uid and gid of its own
  (`AGENT_UID_BASE` + a hash of the execution key), with no supplementary groups. Its workspace
  and input file are its own; the directories above them get only the traverse bit for others,
  so it reaches its workspace by name but can list and read nothing else (secrets are 0600,
  the logs and servers' directories 0700). A different uid also closes /proc: no other
  process's environment, `cwd` or `root` can be opened, nor signalled.
- `namespace` (not root, and the kernel allows unprivileged user namespaces): the agent runs in
  user, mount and PID namespaces (`local_sandbox.py`) where the data dir is an empty tmpfs with
  only its workspace and input file bound back, and /proc lists its own processes only.
- `none`: the agent runs as the controller's user with a clean environment only. An agent that
  walks up from its workspace can read the data dir; nothing here stops it.

`auto` picks `user` as root, else `namespace` where it works, else `none` (the controller logs
which one it uses). In every mode the agent's environment holds only what `local.INHERITED_ENV`
lets through, its proxy URL, its token and what the run names; never the admin token or a URL
with credentials.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

MODES = ("auto", "user", "namespace", "none")
SANDBOX = Path(__file__).with_name("local_sandbox.py")
AGENT_UID_BASE = 0x60000000
"""Agents' uids (and gids) start here, far above any login or container user's range."""


class IsolationError(ValueError):
    """An isolation mode this machine cannot provide; the message says why and what to choose."""


@functools.cache
def namespaces_work(python: str = sys.executable) -> bool:
    """Whether this user may create user, mount and PID namespaces here (asked once, in a child)."""
    try:
        probe = subprocess.run([python, "-I", "-S", str(SANDBOX), "--probe"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def resolve(mode: str, python: str = sys.executable) -> str:
    """The mode `mode` stands for on this machine (`auto` decided); raises IsolationError if unavailable."""
    if mode not in MODES:
        raise IsolationError(f"unknown agent isolation {mode!r}; allowed: {', '.join(MODES)}")
    root = os.geteuid() == 0
    if mode == "auto":
        return "user" if root else ("namespace" if namespaces_work(python) else "none")
    if mode == "user" and not root:
        raise IsolationError("agent isolation 'user' needs the controller to run as root; choose namespace or none")
    if mode == "namespace" and not namespaces_work(python):
        raise IsolationError(
            "agent isolation 'namespace' needs unprivileged user namespaces, which this kernel refuses; "
            "run as root (isolation 'user') or choose none"
        )
    return mode


def agent_uid(key: str) -> int:
    """The uid (and gid) of the execution named `key`: its own, so agents cannot read one another."""
    return AGENT_UID_BASE + int(hashlib.sha256(key.encode()).hexdigest()[:6], 16)


def _traversable(path: Path) -> None:
    """Give others the traverse bit (not read) on `path` and every directory above it."""
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            directory.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def _reachable_programs(commands: list[list[str]], path: str | None) -> None:
    """Let other users reach each command's program (and what its symlinks lead to): traverse bits only.

    As root the interpreter often lives under /root (0700); an agent running as another user could
    not start it. This is what embedded Postgres does for its own binaries.
    """
    for command in commands:
        found = shutil.which(command[0], path=path) if command else None
        if found is None:
            continue
        for program in {Path(found).absolute(), Path(os.path.realpath(found))}:
            _traversable(program.parent)


def prepare(
    mode: str,
    key: str,
    workspace: Path,
    input_file: Path,
    hidden: tuple[Path, ...],
    commands: list[list[str]] = [],  # noqa: B006 - never mutated
    path: str | None = None,
) -> dict[str, object]:
    """Set the execution's files up for `mode` and return the supervisor's `isolation` record.

    `commands` are the agent's and the evaluator's, found on `path` (the agent's PATH).
    """
    if mode == "user":
        uid = agent_uid(key)
        for owned in (workspace, input_file):
            os.chown(owned, uid, uid)
        workspace.chmod(0o700)
        input_file.chmod(0o400)
        _traversable(workspace.parent)
        _reachable_programs(commands, path)
        return {"mode": "user", "uid": uid, "gid": uid}
    if mode == "namespace":
        return {
            "mode": "namespace",
            "sandbox": str(SANDBOX),
            "hide": [str(path) for path in hidden],
            "keep": [str(workspace), str(input_file)],
            "cwd": str(workspace),
        }
    return {"mode": "none"}
