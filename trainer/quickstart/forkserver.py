"""A fork server for Python agents: import the harness once, fork a fresh process per rollout.

Starting a Python agent costs far more CPU than running the quickstart's tiny model: importing
`openai` alone takes about a second, and a training step launches dozens of agents. So the
quickstart starts this server once; it imports the agent module, then waits on a Unix socket.
The command the controller launches for each rollout is `launch.py` (standard library only,
starts in milliseconds): it connects, hands over its environment, working directory and standard
streams (file descriptors over the socket), and waits. The server forks; the child takes that
environment and those streams and runs the agent's `main()` exactly as a fresh process would;
the launcher exits with the child's exit code. If the launcher is killed (a timeout, a
cancelled rollout), the server kills the child's process group.

The server is single-threaded, so forking it is safe (no lock can be held by another thread).

    python -m trainer.quickstart.forkserver SOCKET [MODULE]     (MODULE defaults to the quickstart agent)
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import random
import selectors
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path

DEFAULT_MODULE = "trainer.quickstart.agent"
LAUNCHER = Path(__file__).with_name("launch.py")
HEADER = struct.Struct("!I")


def launcher_command(socket_path: Path) -> list[str]:
    """The agent command to give the controller: the launcher script, isolated and without `site`."""
    return [sys.executable, "-I", "-S", str(LAUNCHER), str(socket_path)]


def _receive_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    """The launcher's JSON header (env, cwd) and its three standard stream descriptors."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("the launcher hung up before sending its request")
        data += more
    (size,) = HEADER.unpack_from(data)
    request = json.loads(data[HEADER.size : HEADER.size + size])
    if len(fds) != 3:
        raise ConnectionError(f"the launcher sent {len(fds)} descriptors, expected 3")
    return request, fds


def _run_child(module_name: str, request: dict[str, object], fds: list[int]) -> None:
    """In the forked child: become the agent process the launcher stands for, run it, exit."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        env = request.get("env")
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in (env.items() if isinstance(env, dict) else [])})
        os.chdir(str(request.get("cwd") or "/"))
        random.seed()  # the parent's random state must not be shared by every child
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        module = sys.modules[module_name]
        module.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def preload(module_name: str) -> None:
    """Import the agent module and run its `warmup()` if it has one, then freeze the heap.

    `warmup` does the per-process work every child would otherwise repeat (lazy imports inside
    client libraries). `gc.freeze()` moves everything loaded so far out of the collector's reach,
    so children neither scan it nor touch (and so copy) its pages.
    """
    module = importlib.import_module(module_name)
    warmup = getattr(module, "warmup", None)
    if callable(warmup):
        warmup()
    gc.collect()
    gc.freeze()


def serve(socket_path: Path, module_name: str = DEFAULT_MODULE) -> None:
    """Preload `module_name`, listen on `socket_path` and fork one child per launcher until SIGTERM."""
    preload(module_name)
    socket_path = Path(socket_path)
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(256)
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    children: dict[int, socket.socket] = {}  # child pid -> its launcher's connection
    print(f"forkserver ready on {socket_path}", flush=True)
    while not stopping:
        for key, _ in selector.select(timeout=0.05):
            if key.data is None:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive_request(conn)
                except (OSError, ValueError, ConnectionError) as exc:
                    print(f"forkserver: bad request: {exc}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    conn.close()
                    _run_child(module_name, request, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:
                # The launcher never writes after its request: readable means it hung up (killed).
                pid = key.data
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                selector.unregister(key.fileobj)
        _reap(children, selector)
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    _reap(children, selector, block=True)
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector, block: bool = False) -> None:
    """Collect exited children and tell each one's launcher its exit code."""
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            conn.sendall(struct.pack("!i", code))
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn)
        conn.close()


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m trainer.quickstart.forkserver SOCKET [MODULE]`."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m trainer.quickstart.forkserver SOCKET [MODULE]")
    serve(Path(args[0]), args[1] if len(args) > 1 else DEFAULT_MODULE)


if __name__ == "__main__":
    main()
