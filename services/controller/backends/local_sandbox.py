"""Run one command with some directories hidden from it: user, mount and PID namespaces, no root needed.

    python -I -S local_sandbox.py '<json>' COMMAND...
    json: {"hide": ["<data dir>"], "keep": ["<workspace>", "<input file>"], "cwd": "<workspace>"}

The local backend's isolation for a user who is not root (standard library only, like the
supervisor that starts it). In order:

1. new user, mount and PID namespaces; the user keeps its own uid and gid inside (mapped 1:1);
2. every `hide` directory is covered by an empty tmpfs, and each `keep` path under one is
   bind-mounted back at its own path (the workspace, the input file): the rest of the data dir —
   admin token, credentials, logs, other executions — is not there for the command;
3. a fork becomes PID 1 of the new PID namespace, mounts a fresh /proc (so no other process's
   environment, `cwd` or `root` link, which would lead back to the host's view, can be opened)
   and runs COMMAND as PID 2, forwarding SIGTERM, SIGINT and SIGHUP to it;
4. the command's exit status is this process's.

The sandbox's own processes are not dumpable, so the command cannot ptrace them to undo the
mounts, and mounts copied into any namespace the command creates are locked by the kernel.
`--probe` exits 0 when the kernel allows all this (unprivileged user namespaces), else 1.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_SET_PDEATHSIG = 4, 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda value: value.encode() if value is not None else None  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def enter_namespaces() -> None:
    """New user (same uid and gid inside), mount and PID namespaces; mounts stop propagating out."""
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID), "unshare")
    with open("/proc/self/setgroups", "w") as handle:
        handle.write("deny")
    with open("/proc/self/uid_map", "w") as handle:
        handle.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as handle:
        handle.write(f"{gid} {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def hide(directories: list[str], keep: list[str]) -> None:
    """Cover each directory with an empty tmpfs, then bind each kept path back where it was."""
    held = {path: os.open(path, os.O_PATH) for path in keep if os.path.exists(path)}
    for directory in directories:
        if os.path.isdir(directory):
            _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    for path, fd in held.items():
        if os.path.exists(path):
            continue  # it was not under a hidden directory
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)


def _status(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def init(command: list[str], cwd: str) -> int:
    """PID 1 of the namespace: a fresh /proc, the command as PID 2, signals forwarded, its status returned."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    child = os.fork()
    if child == 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(cwd)
        try:
            os.execvpe(command[0], command, dict(os.environ))
        except OSError as exc:
            print(f"cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
            os._exit(127)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    while True:
        pid, wait_status = os.wait()  # PID 1 reaps every orphan of the namespace
        if pid == child:
            return _status(wait_status)


def run(config: dict[str, object], command: list[str]) -> int:
    """Enter the namespaces, hide what the config says, run `command` in them; its exit status."""
    enter_namespaces()
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl")  # after the maps: it makes /proc/self root's
    hide([str(p) for p in config.get("hide", [])], [str(p) for p in config.get("keep", [])])  # type: ignore[attr-defined]
    for sig in FORWARDED:  # the whole process group gets the supervisor's signals: PID 1 forwards them
        signal.signal(sig, signal.SIG_IGN)
    pid = os.fork()
    if pid == 0:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os._exit(init(command, str(config.get("cwd") or "/")))
    _, wait_status = os.waitpid(pid, 0)
    return _status(wait_status)


def probe() -> int:
    """0 when this kernel lets this user create the namespaces (in a throwaway child), else 1."""
    pid = os.fork()
    if pid == 0:
        try:
            enter_namespaces()
        except OSError:
            os._exit(1)
        os._exit(0)
    _, wait_status = os.waitpid(pid, 0)
    return 0 if os.waitstatus_to_exitcode(wait_status) == 0 else 1


def main(argv: list[str]) -> int:
    """`local_sandbox.py '<json>' COMMAND...`, or `local_sandbox.py --probe`."""
    if argv[1:2] == ["--probe"]:
        return probe()
    try:
        return run(json.loads(argv[1]), argv[2:])
    except OSError as exc:
        print(f"rollwire sandbox: cannot isolate the command: {exc}", file=sys.stderr, flush=True)
        return 126


if __name__ == "__main__":
    sys.exit(main(sys.argv))
