"""Controller settings, read once from the command line and the environment (typer flags with `envvar=`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import typer

from schemas import InvalidId, check_id
from schemas.ids import STREAM_NAME
from services.common.settings import parse_command, typer_app

KNOWN_BACKENDS = ("local", "kubernetes")


class SettingsError(ValueError):
    """A setting the controller cannot use; the message names the flag or variable."""


class ControllerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the controller needs to know at start.

    `runs` limits the controller to some runs (empty: every run); `backends` to some executors,
    so one controller can run local processes and another Kubernetes Jobs for the same stream.
    `resync_s` is the period of the full reconcile (backend listings, rollout statuses);
    `kill_grace_s` how long past its timeout an execution may run before the controller stops it
    itself (backends enforce timeouts on their own; this is the backstop).
    """

    gateway_url: str
    admin_token: str
    nats_url: str = "nats://127.0.0.1:4222"
    stream: str = STREAM_NAME
    durable: str = "controller"
    runs: tuple[str, ...] = ()
    backends: tuple[str, ...] = KNOWN_BACKENDS
    executions_dir: Path = Path(".rollwire/executions")
    data_dir: Path = Path(".rollwire")
    agent_isolation: str = "none"
    """How local agents are kept from the stack's secrets: auto, user, namespace or none
    (`backends/local_isolation.py`); `rollwire up` sets auto."""
    local_capacity: int = 32
    local_kill_grace_s: float = 5.0
    resync_s: float = 5.0
    kill_grace_s: float = 30.0
    max_inflight: int = 128
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None


def _positive(name: str, value: float) -> float:
    if value <= 0:
        raise SettingsError(f"{name} must be positive, got {value:g}")
    return value


def _required(name: str, flag: str, value: str) -> str:
    if not value:
        raise SettingsError(f"no {name}: pass {flag} or set {ENV_NAMES[flag]}")
    return value


def _backends(raw: str) -> tuple[str, ...]:
    backends = tuple(b.strip() for b in raw.split(",") if b.strip())
    unknown = [b for b in backends if b not in KNOWN_BACKENDS]
    if unknown or not backends:
        raise SettingsError(f"unknown backend(s) {unknown or raw!r}; allowed: {', '.join(KNOWN_BACKENDS)}")
    return backends


def _isolation(raw: str) -> str:
    from services.controller.backends.local_isolation import MODES

    if raw not in MODES:
        raise SettingsError(
            f"unknown agent isolation {raw!r} ({ENV_NAMES['--agent-isolation']}); allowed: {', '.join(MODES)}"
        )
    return raw


def _runs(runs: Sequence[str]) -> tuple[str, ...]:
    try:
        return tuple(check_id("--run", run) for run in runs)
    except InvalidId as exc:
        raise SettingsError(str(exc)) from None


ENV_NAMES = {
    "--gateway-url": "ROLLWIRE_GATEWAY_URL",
    "--admin-token": "ROLLWIRE_ADMIN_TOKEN",
    "--nats-url": "NATS_URL",
    "--stream": "ROLLWIRE_STREAM",
    "--backends": "ROLLWIRE_CONTROLLER_BACKENDS",
    "--executions-dir": "ROLLWIRE_EXECUTIONS_DIR",
    "--data-dir": "ROLLWIRE_DATA_DIR",
    "--local-capacity": "ROLLWIRE_LOCAL_CAPACITY",
    "--agent-isolation": "ROLLWIRE_AGENT_ISOLATION",
    "--durable": "ROLLWIRE_CONTROLLER_DURABLE",
    "--resync-s": "ROLLWIRE_CONTROLLER_RESYNC_S",
    "--metrics-host": "ROLLWIRE_CONTROLLER_HOST",
    "--metrics-port": "ROLLWIRE_CONTROLLER_PORT",
}
"""Each flag's environment variable (the flag wins)."""

app = typer_app("Turn queued rollouts into agent executions (local processes or Kubernetes Jobs).")


def _option(flag: str, default: Any, help: str) -> Any:
    return typer.Option(default, flag, envvar=ENV_NAMES[flag], help=help)


@app.command()
def settings_command(
    gateway_url: str = _option("--gateway-url", "", "The gateway's base URL."),
    admin_token: str = _option("--admin-token", "", "The gateway's admin token."),
    nats_url: str = _option("--nats-url", "nats://127.0.0.1:4222", "NATS server URL."),
    stream: str = _option("--stream", STREAM_NAME, "JetStream stream name."),
    runs: list[str] = typer.Option([], "--run", help="Serve only this run (repeatable; default: all)."),
    backends: str = _option("--backends", ",".join(KNOWN_BACKENDS), "Comma-separated executors this controller runs."),
    data_dir: Path = _option("--data-dir", Path(".rollwire"), "Data directory (executions go under it)."),
    executions_dir: Path | None = _option("--executions-dir", None, "Where local executions keep their files."),
    local_capacity: int = _option("--local-capacity", 32, "Most local executions running at once."),
    agent_isolation: str = _option(
        "--agent-isolation", "none", "Keep local agents from the data dir: auto, user (root), namespace or none."
    ),
    durable: str = _option("--durable", "controller", "Name of the durable NATS consumer."),
    resync_s: float = _option("--resync-s", 5.0, "Period of the full reconcile in seconds."),
    metrics_host: str = _option("--metrics-host", "127.0.0.1", "Address of /metrics and /healthz."),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        envvar=ENV_NAMES["--metrics-port"],
        min=0,
        max=65535,
        help="Port of /metrics and /healthz (0: any free port; default: none).",
    ),
) -> ControllerSettings:
    """The controller's settings from its flags and their environment variables."""
    return ControllerSettings(
        gateway_url=_required("gateway URL", "--gateway-url", gateway_url),
        admin_token=_required("admin token", "--admin-token", admin_token),
        nats_url=nats_url,
        stream=stream or STREAM_NAME,
        durable=durable,
        runs=_runs(runs),
        backends=_backends(backends),
        executions_dir=executions_dir or data_dir / "executions",
        data_dir=data_dir,
        agent_isolation=_isolation(agent_isolation),
        local_capacity=int(_positive(ENV_NAMES["--local-capacity"], local_capacity)),
        resync_s=_positive(ENV_NAMES["--resync-s"], resync_s),
        metrics_host=metrics_host,
        metrics_port=metrics_port,
    )


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> ControllerSettings:
    """Settings from a command line, then `env` (default: the process environment), then defaults.

    Raises SettingsError naming the flag or variable; `--help` prints the flags and exits.
    """
    try:
        return parse_command(app, argv, env, prog="python -m services.controller")
    except typer.TyperException as exc:
        raise SettingsError(exc.format_message()) from None
