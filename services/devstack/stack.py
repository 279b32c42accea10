"""The local stack behind `rollwire up`: nats-server, Postgres and every Rollwire service.

Everything runs as child processes of one foreground command, with no Docker (what it is asked
for and answers, `StackConfig` and `Endpoints`: `stack_config.py`):

1. take an exclusive lock on the data dir (two stacks on one data dir would corrupt it);
2. check every port first, so a busy port fails before anything starts;
3. start nats-server (JetStream) and Postgres from their wheels, data under the data dir;
4. start each service (`python -m services.<name>`; the engine's vLLM replicas and their
   registration with the gateway: `engine_models.py`), wait for its health check;
5. supervise them: a child that dies is restarted with backoff (`supervise.py`); only repeated
   fast failure stops the stack;
6. on Ctrl-C / SIGTERM stop them in reverse order.

Secrets (the admin token and the token-signing key) are generated once and kept in the data dir,
so agents' tokens stay valid across restarts; `ROLLWIRE_ADMIN_TOKEN` / `ROLLWIRE_SECRET` override.
So are the NATS users and the Postgres password (`credentials.py`): each service gets only its
own, inside its NATS_URL / DATABASE_URL; what is printed and saved in `endpoints.json` has none.
The data dir is 0700 (0711 when agents run as another user, see the controller's README) and its
secrets 0600. Every child dies with `rollwire up`, even one killed by SIGKILL (`die_with_parent`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO

import httpx

from services.devstack import credentials, endpoints_file
from services.devstack.embedded import (
    EmbeddedServerError,
    NatsServer,
    PostgresServer,
    free_port,
    port_in_use,
    reap_group,
)
from services.devstack.engine_models import register_model, register_replicas, tokenizer_args, vllm_replicas
from services.devstack.stack_config import (
    DEFAULT_GATEWAY_PORT,
    DEFAULT_MODEL_NAME,
    DEFAULT_NATS_PORT,
    DEFAULT_PG_PORT,
    ChildService,
    Endpoints,
    StackConfig,
    StackError,
)
from services.devstack.supervise import Unit

__all__ = [
    "DEFAULT_GATEWAY_PORT",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_NATS_PORT",
    "DEFAULT_PG_PORT",
    "ChildService",
    "Endpoints",
    "Stack",
    "StackConfig",
    "StackError",
    "register_model",
]


class Stack:
    """Start and stop the whole local stack (see the module docstring)."""

    def __init__(self, config: StackConfig, say: Callable[[str], None] = print) -> None:
        self.config = config
        self.say = say
        self.data_dir = config.data_dir.resolve()
        self._lock_file: IO[str] | None = None
        self.nats: NatsServer | None = None
        self.postgres: PostgresServer | None = None
        self.children: list[ChildService] = []
        self.endpoints: Endpoints | None = None
        self._env: dict[str, str] = {}
        self._credentials = credentials.Credentials(nats={}, postgres="")
        self._engine_key = ""
        self._vllm_ports: list[int] = []

    # ---- start -----------------------------------------------------------------------------

    def start(self) -> Endpoints:
        """Start everything and return the endpoints; raises StackError with one readable line."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock()
        try:
            endpoints = self._start_locked()
            endpoints_file.write(self.data_dir, endpoints.lines)
            credentials.restrict_data_dir(self.data_dir)
            return endpoints
        except BaseException:
            self.stop()
            raise

    def _lock(self) -> None:
        lock_path = self.data_dir / "stack.lock"
        handle = os.fdopen(os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            gateway = endpoints_file.read(self.data_dir).get("gateway")
            raise StackError(
                f"data dir {self.data_dir} is in use by another running stack (`rollwire up`, pid {owner}"
                + (f", gateway {gateway}" if gateway else "")
                + "); stop it or pass another --data-dir",
                exit_code=2,
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock_file = handle

    def _ports(self) -> dict[str, int]:
        cfg = self.config
        ports = {
            "gateway": cfg.gateway_port or free_port(),
            "projector": free_port(),
            "controller": free_port(),
        }
        if not cfg.external:
            ports["nats"] = cfg.nats_port or free_port()
            ports["postgres"] = cfg.pg_port or free_port()
        needed = {name: port for name, port in ports.items() if name in ("nats", "postgres") or name in cfg.services}
        for name, port in needed.items():
            if port_in_use(port):
                flag = {"nats": "--nats-port", "postgres": "--pg-port", "gateway": "--gateway-port"}.get(name, "")
                raise StackError(
                    f"port {port} for {name} is already in use; free it or choose another with {flag}".rstrip(),
                    exit_code=2,
                )
        return ports

    def _start_locked(self) -> Endpoints:
        ports = self._ports()
        admin_token, generated = credentials.read_or_create_secret(
            self.data_dir / "admin_token", "ROLLWIRE_ADMIN_TOKEN"
        )
        signing_key, _ = credentials.read_or_create_secret(self.data_dir / "secret", "ROLLWIRE_SECRET")
        service_urls, endpoints = self._servers(ports, admin_token)
        if generated:
            endpoints.lines.append(f"admin token: {admin_token} (saved in {self.data_dir / 'admin_token'})")
        self._env = self._child_env(ports, admin_token, signing_key)
        for spec in self._service_specs(ports):
            spec.env = {**service_urls.get(spec.name, {}), **spec.env}
            self._start_child(spec, self._env)
            if spec.endpoint:
                endpoints.lines.append(spec.endpoint)
        self._engine_endpoints(endpoints, ports)
        self.endpoints = endpoints
        return endpoints

    def _servers(self, ports: dict[str, int], admin_token: str) -> tuple[dict[str, dict[str, str]], Endpoints]:
        """NATS and Postgres, started here or (`--external`) from NATS_URL and DATABASE_URL: each
        service's URLs, and the endpoints so far."""
        if self.config.external:
            nats_url = os.environ.get("NATS_URL", "")
            database_url = os.environ.get("DATABASE_URL", "")
            if not nats_url or not database_url:
                raise StackError("--external needs NATS_URL and DATABASE_URL of running servers", exit_code=2)
            service_urls = {name: {"NATS_URL": nats_url} for name in ("gateway", "projector", "controller")}
            service_urls["projector"]["DATABASE_URL"] = database_url
            trainer_url = monitor_url = nats_url
        else:
            service_urls, database_url = self._start_servers(ports)
            assert self.nats is not None
            nats_url = self.nats.url
            trainer_url = self._credentials.nats_url(nats_url, "trainer")
            monitor_url = self._credentials.nats_url(nats_url, "monitor")
        endpoints = Endpoints(
            nats_url=trainer_url, database_url=database_url, admin_token=admin_token, monitor_nats_url=monitor_url
        )
        endpoints.lines += [
            f"nats: {credentials.without_userinfo(nats_url)}",
            f"postgres: {credentials.without_userinfo(database_url)}",
        ]
        if not self.config.external:
            endpoints.lines.append(f"credentials: {self.data_dir / credentials.FILE}")
        return service_urls, endpoints

    def _child_env(self, ports: dict[str, int], admin_token: str, signing_key: str) -> dict[str, str]:
        """The environment every service starts with (its own URLs come on top; never another's)."""
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("NATS_URL", "DATABASE_URL")},
            "ROLLWIRE_ADMIN_TOKEN": admin_token,
            "ROLLWIRE_SECRET": signing_key,
            "ROLLWIRE_DATA_DIR": str(self.data_dir),
            "ROLLWIRE_AGENT_ISOLATION": os.environ.get("ROLLWIRE_AGENT_ISOLATION", self.config.agent_isolation),
            "ROLLWIRE_GATEWAY_URL": f"http://127.0.0.1:{ports['gateway']}",
            "ROLLWIRE_PUBLIC_URL": f"http://127.0.0.1:{ports['gateway']}",
            "PYTHONUNBUFFERED": "1",
        }
        if "projector" in self.config.services:  # the gateway forwards reads to it
            env["ROLLWIRE_PROJECTOR_URL"] = f"http://127.0.0.1:{ports['projector']}"
        return env

    def _engine_endpoints(self, endpoints: Endpoints, ports: dict[str, int]) -> None:
        """The gateway's and the vLLM replicas' URLs; the replicas registered with the gateway as the default model."""
        if "gateway" in self.config.services:
            endpoints.gateway_url = f"http://127.0.0.1:{ports['gateway']}"
        if "engine" in self.config.services:
            endpoints.engine_urls = [f"http://{self.config.vllm.host}:{port}/v1" for port in self._vllm_ports]
            endpoints.engine_url, endpoints.engine_api_key = endpoints.engine_urls[0], self._engine_key
            if endpoints.gateway_url:
                register_replicas(endpoints)

    def _start_servers(self, ports: dict[str, int]) -> tuple[dict[str, dict[str, str]], str]:
        """Start nats-server (a user per service) and Postgres (a password); each service's URLs, and Postgres'."""
        self._credentials = credentials.load_or_create(self.data_dir)
        try:
            self.nats = NatsServer(
                self.data_dir / "nats",
                ports["nats"],
                authorization=credentials.nats_authorization(self._credentials),
                tied=True,
            ).start()
            self.postgres = PostgresServer(
                self.data_dir / "postgres",
                ports["postgres"],
                durable=self.config.durable_postgres,
                password=self._credentials.postgres,
                tied=True,
            ).start()
        except EmbeddedServerError as exc:
            raise StackError(str(exc)) from None
        database_url = self._credentials.postgres_url(self.postgres.url)
        urls = {
            name: {"NATS_URL": self._credentials.nats_url(self.nats.url, name)} for name in ("gateway", "controller")
        }
        urls["projector"] = {
            "NATS_URL": self._credentials.nats_url(self.nats.url, "projector"),
            "DATABASE_URL": database_url,
        }
        return urls, database_url

    def _service_specs(self, ports: dict[str, int]) -> list[ChildService]:
        """The services to start, in order, for the names in the config."""
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        known = {
            "gateway": ChildService(
                "gateway",
                ["--host", "127.0.0.1", "--port", str(ports["gateway"])],
                health_url=f"{gateway}/healthz",
                endpoint=f"gateway: {gateway}",
            ),
            "projector": ChildService(
                "projector",
                ["--port", str(ports["projector"]), *tokenizer_args(self.config)],
                health_url=f"http://127.0.0.1:{ports['projector']}/healthz",
                endpoint=f"projector: http://127.0.0.1:{ports['projector']}/metrics",
            ),
            "controller": ChildService(
                "controller",
                ["--metrics-port", str(ports["controller"])],
                health_url=f"http://127.0.0.1:{ports['controller']}/healthz",
                endpoint=f"controller: http://127.0.0.1:{ports['controller']}/metrics",
            ),
        }
        # The engine's vLLM replicas first; the projector before the gateway: the gateway's reads, and
        # so its /healthz, depend on it.
        replicas = self._vllm_children() if "engine" in self.config.services else []
        order = ("projector", "gateway", "controller")
        return replicas + [known[name] for name in order if name in self.config.services]

    def _vllm_children(self) -> list[ChildService]:
        """The vLLM replicas' children (`engine_models`); their ports and key are kept for the endpoints."""
        replicas = vllm_replicas(self.config, self.data_dir, self.say)
        self._vllm_ports, self._engine_key = replicas.ports, replicas.api_key
        return replicas.children

    def _start_child(self, spec: ChildService, env: dict[str, str]) -> None:
        self._spawn(spec, env)
        self.children.append(spec)
        if spec.health_url:
            self._wait_healthy(spec, timeout=spec.startup_s)

    def _spawn(self, spec: ChildService, env: dict[str, str]) -> None:
        logs = self.data_dir / "logs"
        logs.mkdir(exist_ok=True)
        if spec.log is None:
            spec.log = open(logs / f"{spec.name}.log", "ab")
        spec.proc = subprocess.Popen(
            spec.command or [sys.executable, "-m", f"services.{spec.name}", *spec.args],
            stdout=spec.log,
            stderr=subprocess.STDOUT,
            env={**env, **spec.env},
            start_new_session=True,
            preexec_fn=credentials.child_setup,
        )

    def units(self) -> list[Unit]:
        """Every process of the stack, for the supervisor (`supervise.py`): servers first, then services."""
        out: list[Unit] = []
        servers: list[NatsServer | PostgresServer] = [s for s in (self.nats, self.postgres) if s is not None]
        for server in servers:
            name = "nats" if isinstance(server, NatsServer) else "postgres"
            log = server.data_dir / f"{name}.log"
            out.append(Unit(name, partial(_proc_of, server), partial(_restart_server, server, self.data_dir), log))
        for child in self.children:
            log = self.data_dir / "logs" / f"{child.name}.log"
            out.append(Unit(child.name, partial(_proc_of, child), partial(self._spawn, child, self._env), log))
        return out

    def _wait_healthy(self, spec: ChildService, timeout: float) -> None:
        assert spec.proc is not None and spec.health_url is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if spec.proc.poll() is not None:
                raise StackError(
                    f"{spec.name} exited with code {spec.proc.returncode}; see {self.data_dir / 'logs' / spec.name}.log"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(spec.health_url, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise StackError(f"{spec.name} did not become healthy within {timeout:.0f}s")

    # ---- run and stop ----------------------------------------------------------------------

    def dead_child(self) -> ChildService | None:
        """A service that exited on its own, if any (the stack then stops)."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                return child
        return None

    def stop(self) -> None:
        """Stop services in reverse order, then Postgres and nats-server; release the lock."""
        for child in reversed(self.children):
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            if child.proc is not None:
                reap_group(child.proc, 15)
            if child.log is not None:
                child.log.close()
        self.children.clear()
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self._lock_file is not None:  # only the stack holding the lock owns the endpoints file
            endpoints_file.remove(self.data_dir)
            self._lock_file.close()
            self._lock_file = None


def _proc_of(owner: NatsServer | PostgresServer | ChildService) -> subprocess.Popen[bytes] | None:
    return owner.proc


def _restart_server(server: NatsServer | PostgresServer, data_dir: Path) -> None:
    server.proc = None  # it died: start it again on its port and data dir
    server.start()
    credentials.restrict_data_dir(data_dir)  # as root, starting Postgres opens its parents for its own user
