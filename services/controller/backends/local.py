"""The local backend: each attempt runs as a supervised process group on this machine.

Layout under the backend's root directory (by default `$ROLLWIRE_DATA_DIR/executions`):

    runs/<run>/<rollout>/<attempt>/   one execution: spec.json, input.json, logs, result.json,
                                      workspace/ (see `local_supervisor` for every file)
    active/<digest>                   a symlink to each execution the backend still owns

The execution directory is the executor's own record, so the backend keeps no state that a
restart could lose. `list()` reads `active/` and each directory (`local_state`): an execution
with `result.json` has ended; one whose `lock` file is flock-ed is alive (the supervisor inherits
the lock from `launch` at fork time, so there is no moment when a started execution looks
unstarted); one with neither never started or lost its supervisor. `cancel` stops an execution
and drops it from `active/`, but keeps its directory: logs outlive executions, and the rollout's
`log` event points at them.

Why supervised and in their own session: the supervisor (`local_supervisor.py`) is the leader of
a new session, so executions survive a controller that crashes, restarts or is upgraded; the
next controller finds them in `active/` and takes them over. The supervisor enforces the
timeout and records the exit status itself, so neither depends on a controller being up.
Timeouts and cancellation kill the agent's whole process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

from services.controller.backends import local_isolation
from services.controller.backends.base import (
    INPUT_ENV,
    INPUT_ENV_LIMIT,
    INPUT_FILE_ENV,
    ExecutionKey,
    ExecutionState,
    LaunchSpec,
    PermanentBackendError,
    RolloutKey,
    TemporaryBackendError,
)
from services.controller.backends.local_state import ended_state, lock_held, read_result, unended_state

SUPERVISOR = Path(__file__).with_name("local_supervisor.py")
INHERITED_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "TERM",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
)
"""Variables an agent inherits from the controller's environment; nothing else (the controller's
own environment holds the admin token, which an untrusted agent must never see)."""


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _signal_group(pgid: int | None, sig: int) -> None:
    if pgid is None or pgid <= 1:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class LocalBackend:
    """Runs attempts as local processes (see the module docstring)."""

    name = "local"

    def __init__(
        self,
        root: Path,
        *,
        capacity: int | None = 32,
        kill_grace_s: float = 5.0,
        poll_s: float = 1.0,
        python: str = sys.executable,
        isolation: str = "none",
        hidden: tuple[Path, ...] = (),
    ) -> None:
        self.root = Path(root).resolve()
        try:
            self.isolation = local_isolation.resolve(isolation, python)
        except local_isolation.IsolationError as exc:
            raise PermanentBackendError(str(exc)) from None
        if isolation != "none":
            logging.getLogger("rollwire.controller").log(
                logging.WARNING if self.isolation == "none" else logging.INFO,
                "local agents: isolation %s%s",
                self.isolation,
                " (no root and no user namespaces here: agents can read what this user reads)"
                if self.isolation == "none"
                else "",
            )
        """How agents are kept from the stack's secrets (`local_isolation`): user, namespace or none."""
        self.hidden = tuple(Path(path).resolve() for path in hidden) or (self.root,)
        """What a `namespace`-isolated agent cannot see (default: this backend's root)."""
        self.capacity = capacity
        self.kill_grace_s = kill_grace_s
        self.poll_s = poll_s
        self.python = python
        self._active = self.root / "active"
        self._runs = self.root / "runs"
        self._active.mkdir(parents=True, exist_ok=True)
        self._runs.mkdir(parents=True, exist_ok=True)
        self._ended: dict[ExecutionKey, ExecutionState] = {}
        self._published: dict[ExecutionKey, ExecutionState] = {}
        self._watchers: set[asyncio.Queue[ExecutionState | None]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._children: set[ExecutionKey] = set()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False

    # ---- paths -----------------------------------------------------------------------------

    def directory(self, key: ExecutionKey) -> Path:
        """The execution directory of `key` (kept after the execution ends, for its logs)."""
        return self._runs / key.run_id / key.rollout_id / key.attempt_id

    def _index(self, key: ExecutionKey) -> Path:
        digest = hashlib.sha256(f"{key.run_id}/{key.rollout_id}/{key.attempt_id}".encode()).hexdigest()[:40]
        return self._active / digest

    # ---- launch ----------------------------------------------------------------------------

    def _environment(self, spec: LaunchSpec, env: dict[str, str], input_file: Path) -> dict[str, str]:
        base = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
        merged = {**base, "PYTHONUNBUFFERED": "1", **env, INPUT_FILE_ENV: str(input_file)}
        if len(spec.input_json.encode()) <= INPUT_ENV_LIMIT:
            merged[INPUT_ENV] = spec.input_json
        return merged

    async def launch(self, spec: LaunchSpec) -> None:
        """Start the execution of `spec.key` under a supervisor; an existing execution is left alone."""
        if self._closed:
            raise TemporaryBackendError("the local backend is closed")
        if not spec.command:
            raise PermanentBackendError(
                "the run sets no command: the local backend needs RunSpec.command (an argv list)"
            )
        key = spec.key
        directory = self.directory(key)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise TemporaryBackendError(f"cannot create the execution directory {directory}: {exc}", 5.0) from None
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a supervisor holds it: the execution runs already
            if (directory / "result.json").exists() or (directory / "supervisor.pid").exists():
                return  # it ran (or started) before: never start an attempt twice
            await self._start_supervisor(spec, directory, lock_fd)
        finally:
            os.close(lock_fd)  # the supervisor keeps the lock through its inherited descriptor
        self._publish(self._state(key))

    def _prepare(self, spec: LaunchSpec, directory: Path) -> None:
        """Write the execution's input and spec, and index it, before its supervisor starts."""
        workspace = directory / "workspace"
        input_file = directory / "input.json"
        workspace.mkdir(exist_ok=True)
        input_file.write_text(spec.input_json)
        name = f"{spec.key.run_id}/{spec.key.rollout_id}/{spec.key.attempt_id}"
        commands = [command for command in (spec.command, spec.evaluator_command) if command]
        isolation = local_isolation.prepare(
            self.isolation, name, workspace, input_file, self.hidden, commands, os.environ.get("PATH")
        )
        home = {"HOME": str(workspace)} if self.isolation == "user" else {}  # the controller's is not theirs
        record = {
            "key": [spec.key.run_id, spec.key.rollout_id, spec.key.attempt_id],
            "command": spec.command,
            "env": {**self._environment(spec, spec.env, input_file), **home},
            "evaluator_command": spec.evaluator_command,
            "evaluator_env": {**self._environment(spec, spec.evaluator_env or {}, input_file), **home},
            "isolation": isolation,
            "timeout_s": spec.timeout_s,
            "deadline": time.time() + spec.timeout_s,
            "kill_grace_s": self.kill_grace_s,
            "launched_at": time.time(),
        }
        spec_path = directory / "spec.json"
        spec_path.write_text(json.dumps(record))
        spec_path.chmod(0o600)  # it holds the attempt's tokens
        index = self._index(spec.key)
        if not index.is_symlink():
            # Indexed before the start: a launcher dying right after the fork cannot leave an
            # execution that runs but that no listing shows.
            os.symlink(os.path.relpath(directory, self._active), index)

    async def _start_supervisor(self, spec: LaunchSpec, directory: Path, lock_fd: int) -> None:
        try:
            self._prepare(spec, directory)
            stderr = open(directory / "supervisor.log", "ab")
        except OSError as exc:
            raise TemporaryBackendError(f"cannot prepare {directory}: {exc}", 5.0) from None
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python,
                "-I",  # isolated: no user site, no PYTHON* variables
                "-S",  # no site module: the supervisor needs the standard library only
                str(SUPERVISOR),
                str(directory),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
                pass_fds=(lock_fd,),
                start_new_session=True,
            )
        except OSError as exc:
            raise TemporaryBackendError(f"cannot start the supervisor for {directory}: {exc}", 5.0) from None
        finally:
            stderr.close()
        self._spawn(self._reap(spec.key, proc))

    async def _reap(self, key: ExecutionKey, proc: asyncio.subprocess.Process) -> None:
        self._children.add(key)
        try:
            await proc.wait()
        finally:
            self._children.discard(key)
        self._publish(self._state(key))

    # ---- observe ---------------------------------------------------------------------------

    def _keys(self) -> list[ExecutionKey]:
        keys = []
        try:
            entries = list(os.scandir(self._active))
        except FileNotFoundError:
            return []
        for entry in entries:
            try:
                target = Path(os.readlink(entry.path))
            except OSError:
                continue
            parts = target.parts
            if len(parts) >= 3:
                keys.append(ExecutionKey(parts[-3], parts[-2], parts[-1]))
        return keys

    def _state(self, key: ExecutionKey) -> ExecutionState:
        ended = self._ended.get(key)
        if ended is not None:
            return ended
        directory = self.directory(key)
        result = read_result(directory)
        if result is not None:
            self._ended[key] = ended_state(key, directory, result)
            return self._ended[key]
        unended = unended_state(key, directory)
        return self._state(key) if unended is None else unended

    async def list(self) -> list[ExecutionState]:
        """Every execution this backend still owns, as its directory says it is now."""
        return [self._state(key) for key in self._keys()]

    # ---- stop ------------------------------------------------------------------------------

    async def cancel(self, key: ExecutionKey) -> None:
        """Stop `key`'s execution (its whole process group) and stop owning it; its logs stay on disk."""
        directory = self.directory(key)
        was = self._state(key) if self._index(key).is_symlink() else None
        if lock_held(directory / "lock"):
            await self._terminate(directory)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._index(key))
        self._ended.pop(key, None)
        if was is not None:
            final = self._state_after_cancel(key, was)
            self._publish(final)

    def _state_after_cancel(self, key: ExecutionKey, was: ExecutionState) -> ExecutionState:
        if was.terminal:
            return ExecutionState(**{**_fields(was), "deleted": True})
        return ExecutionState(
            key=key,
            phase="failed",
            reason="cancelled by the controller",
            log_location=was.log_location,
            execution=was.execution,
            finished_at=time.time(),
            deleted=True,
        )

    async def _terminate(self, directory: Path) -> None:
        """SIGTERM the supervisor (it stops the agent's group); SIGKILL both groups if it lingers."""
        supervisor = _read_int(directory / "supervisor.pid")
        _signal_group(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s + 2.0
        while time.monotonic() < deadline:
            if not lock_held(directory / "lock"):
                return
            await asyncio.sleep(0.05)
        _signal_group(_read_int(directory / "agent.pid"), signal.SIGKILL)
        _signal_group(supervisor, signal.SIGKILL)

    async def cleanup(self, keep: Collection[RolloutKey]) -> int:
        """Cancel every execution whose rollout is not in `keep`; returns how many."""
        keep_set = set(keep)
        doomed = [key for key in self._keys() if key.rollout not in keep_set]
        for key in doomed:
            await self.cancel(key)
        return len(doomed)

    # ---- watch -----------------------------------------------------------------------------

    def _publish(self, state: ExecutionState) -> None:
        if self._published.get(state.key) == state:
            return
        if state.deleted:
            self._published.pop(state.key, None)
        else:
            self._published[state.key] = state
        for queue in self._watchers:
            queue.put_nowait(state)

    async def _poll(self) -> None:
        """Notice what no child-exit callback reports: executions taken over after a restart, or removed."""
        while not self._closed:
            await asyncio.sleep(self.poll_s)
            # Our own children report their exit through `_reap`; the rest (taken over, or
            # removed by someone) are looked at here.
            current = {key: self._state(key) for key in self._keys() if key not in self._children}
            current.update({key: state for key, state in self._published.items() if key in self._children})
            for key, old in list(self._published.items()):
                if key not in current:
                    final = (
                        old
                        if old.terminal
                        else ExecutionState(
                            key=key,
                            phase="failed",
                            reason="the execution was removed from the backend's directory outside the controller",
                            log_location=old.log_location,
                        )
                    )
                    self._publish(ExecutionState(**{**_fields(final), "deleted": True}))
            for state in current.values():
                self._publish(state)

    async def watch(self) -> AsyncIterator[ExecutionState]:
        """The state of every execution, then each change (exits are reported at once, others by polling)."""
        queue: asyncio.Queue[ExecutionState | None] = asyncio.Queue()
        self._watchers.add(queue)
        if self._poller is None and not self._closed:
            self._poller = asyncio.create_task(self._poll())
        try:
            for state in await self.list():
                self._published.setdefault(state.key, state)
                yield state
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item
        finally:
            self._watchers.discard(queue)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop watching; executions keep running and a later backend on the same root takes them over."""
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for task in list(self._tasks):
            task.cancel()
        for queue in self._watchers:
            queue.put_nowait(None)


def _fields(state: ExecutionState) -> dict[str, Any]:
    return {field: getattr(state, field) for field in state.__struct_fields__}
