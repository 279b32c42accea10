"""Controller settings, read once from the command line and the environment."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from schemas import InvalidId, check_id
from schemas.ids import STREAM_NAME

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
    local_capacity: int = 32
    local_kill_grace_s: float = 5.0
    resync_s: float = 5.0
    kill_grace_s: float = 30.0
    max_inflight: int = 128
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None


def _positive(name: str, raw: str | None, default: float) -> float:
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise SettingsError(f"{name} must be positive, got {raw}")
    return value


def _port(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or int(raw) > 65535:
        raise SettingsError(f"ROLLWIRE_CONTROLLER_PORT / --metrics-port={raw!r} is not a port number (0 to 65535)")
    return int(raw)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of `python -m services.controller` (each flag overrides its variable)."""
    parser = argparse.ArgumentParser(
        prog="python -m services.controller",
        description="Turn queued rollouts into agent executions (local processes or Kubernetes Jobs).",
    )
    parser.add_argument("--gateway-url", help="the gateway's base URL (ROLLWIRE_GATEWAY_URL)")
    parser.add_argument("--nats-url", help="NATS server URL (NATS_URL)")
    parser.add_argument("--admin-token", help="the gateway's admin token (ROLLWIRE_ADMIN_TOKEN)")
    parser.add_argument("--run", action="append", dest="runs", help="serve only this run (repeatable; default: all)")
    parser.add_argument(
        "--backends", help="comma-separated executors this controller runs (ROLLWIRE_CONTROLLER_BACKENDS; default all)"
    )
    parser.add_argument(
        "--executions-dir",
        help="where local executions keep their files (ROLLWIRE_EXECUTIONS_DIR; default $ROLLWIRE_DATA_DIR/executions)",
    )
    parser.add_argument(
        "--local-capacity", help="most local executions running at once (ROLLWIRE_LOCAL_CAPACITY, default 32)"
    )
    parser.add_argument("--durable", help="name of the durable NATS consumer (ROLLWIRE_CONTROLLER_DURABLE)")
    parser.add_argument("--resync-s", help="period of the full reconcile in seconds (ROLLWIRE_CONTROLLER_RESYNC_S)")
    parser.add_argument("--metrics-host", help="address of /metrics and /healthz (ROLLWIRE_CONTROLLER_HOST)")
    parser.add_argument(
        "--metrics-port",
        help="port of /metrics and /healthz (ROLLWIRE_CONTROLLER_PORT; 0: any free port; default off)",
    )
    return parser.parse_args(argv)


def build_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ControllerSettings:
    """Settings from flags, then the environment, then defaults; raises SettingsError naming the problem."""
    env = os.environ if env is None else env
    gateway_url = args.gateway_url or env.get("ROLLWIRE_GATEWAY_URL") or ""
    if not gateway_url:
        raise SettingsError("no gateway URL: pass --gateway-url or set ROLLWIRE_GATEWAY_URL")
    admin_token = args.admin_token or env.get("ROLLWIRE_ADMIN_TOKEN") or ""
    if not admin_token:
        raise SettingsError("no admin token: pass --admin-token or set ROLLWIRE_ADMIN_TOKEN")
    raw_backends = args.backends or env.get("ROLLWIRE_CONTROLLER_BACKENDS") or ",".join(KNOWN_BACKENDS)
    backends = tuple(b.strip() for b in raw_backends.split(",") if b.strip())
    unknown = [b for b in backends if b not in KNOWN_BACKENDS]
    if unknown or not backends:
        raise SettingsError(f"unknown backend(s) {unknown or raw_backends!r}; allowed: {', '.join(KNOWN_BACKENDS)}")
    runs = tuple(args.runs or ())
    try:
        for run in runs:
            check_id("--run", run)
    except InvalidId as exc:
        raise SettingsError(str(exc)) from None
    data_dir = Path(env.get("ROLLWIRE_DATA_DIR") or ".rollwire")
    executions_dir = Path(args.executions_dir or env.get("ROLLWIRE_EXECUTIONS_DIR") or data_dir / "executions")
    metrics_port = _port(getattr(args, "metrics_port", None) or env.get("ROLLWIRE_CONTROLLER_PORT"))
    capacity = _positive("ROLLWIRE_LOCAL_CAPACITY", args.local_capacity or env.get("ROLLWIRE_LOCAL_CAPACITY"), 32)
    return ControllerSettings(
        gateway_url=gateway_url,
        admin_token=admin_token,
        nats_url=args.nats_url or env.get("NATS_URL") or "nats://127.0.0.1:4222",
        stream=env.get("ROLLWIRE_STREAM") or STREAM_NAME,
        durable=args.durable or env.get("ROLLWIRE_CONTROLLER_DURABLE") or "controller",
        runs=runs,
        backends=backends,
        executions_dir=executions_dir,
        local_capacity=int(capacity),
        metrics_host=getattr(args, "metrics_host", None) or env.get("ROLLWIRE_CONTROLLER_HOST") or "127.0.0.1",
        metrics_port=metrics_port,
        resync_s=_positive(
            "ROLLWIRE_CONTROLLER_RESYNC_S", args.resync_s or env.get("ROLLWIRE_CONTROLLER_RESYNC_S"), 5.0
        ),
    )
