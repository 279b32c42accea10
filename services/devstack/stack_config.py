"""What `rollwire up` is asked for and what it answers: the stack's config and default ports, the
child processes it runs, the endpoints it prints, and its one error (`stack` starts them)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.common.vllm import VllmServeSettings

DEFAULT_NATS_PORT = 14222
DEFAULT_PG_PORT = 15432
DEFAULT_GATEWAY_PORT = 18080
DEFAULT_MODEL_NAME = "tiny"


class StackError(RuntimeError):
    """The stack cannot start; the message is the one line a user sees. `exit_code` is 2 for usage errors."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class StackConfig:
    """Where the stack keeps its data and which ports it uses (0 = pick a free one)."""

    data_dir: Path = Path(".rollwire")
    nats_port: int = DEFAULT_NATS_PORT
    pg_port: int = DEFAULT_PG_PORT
    gateway_port: int = DEFAULT_GATEWAY_PORT
    external: bool = False
    services: tuple[str, ...] = ("engine", "gateway", "projector", "controller")
    engine_model: Path | None = None
    durable_postgres: bool = True
    vllm: VllmServeSettings = field(default_factory=VllmServeSettings)
    vllm_replicas: int = 1
    agent_isolation: str = "auto"
    """How the controller keeps local agents from the data dir (`ROLLWIRE_AGENT_ISOLATION` overrides)."""


@dataclass
class ChildService:
    """One Rollwire service running as `python -m services.<name>`."""

    name: str
    args: list[str]
    health_url: str | None = None
    endpoint: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    command: list[str] | None = None  # a program other than `python -m services.<name>` (vLLM)
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float = 120.0


@dataclass
class Endpoints:
    """What a running stack exposes; printed by `rollwire up`, used by the quickstart and tests."""

    nats_url: str
    database_url: str
    gateway_url: str | None = None
    engine_url: str | None = None
    admin_token: str = ""
    engine_urls: list[str] = field(default_factory=list)  # every vLLM replica's /v1
    engine_api_key: str = ""  # what vLLM requires on every route
    lines: list[str] = field(default_factory=list)
    monitor_nats_url: str = ""
    """The read-only NATS user's URL (for `rollwire tail`, monitors); empty with `--external`."""
