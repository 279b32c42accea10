"""`python -m services.projector`: project the stream into Postgres and serve its reads, until SIGTERM or SIGINT.

    python -m services.projector --nats-url nats://127.0.0.1:4222 \\
        --database-url postgresql://postgres@127.0.0.1:5432/postgres --port 18090

One HTTP port serves the query API the gateway forwards reads to, run summaries, the viewer
(`/ui`), `/metrics` and `/healthz` (`services/projector/api.py`). Every flag falls back to its
environment variable (see `--help`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import typer
import uvicorn

from schemas.ids import STREAM_NAME
from services.common.accesslog import AccessLogError, access_format
from services.common.gctune import tune_gc
from services.common.settings import fail, run_async, run_command, typer_app
from services.projector.api import create_query_app
from services.projector.migrate import MigrationError
from services.projector.reader import PostgresRolloutReader
from services.projector.service import Projector, ProjectorSettings
from services.projector.tokens import Detokenizer, TokenizerError

DEFAULT_PORT = 18090
NAME = "rollwire projector"


async def serve(settings: ProjectorSettings, admin_token: str | None) -> None:
    """Serve the projector's HTTP app, project until a signal arrives, drain and exit."""
    try:
        detok = Detokenizer.from_specs(settings.tokenizers)
    except TokenizerError as exc:
        fail(NAME, str(exc))
    projector = Projector(settings, detok)
    tune_gc()
    server: uvicorn.Server | None = None
    reader: PostgresRolloutReader | None = None
    if settings.metrics_port is not None:
        reader = PostgresRolloutReader(settings.database_url, stream=settings.stream)
        app = create_query_app(reader, status=projector.status, admin_token=admin_token)
        config = uvicorn.Config(
            app, host=settings.metrics_host, port=settings.metrics_port, log_level="warning", access_log=False
        )
        server = uvicorn.Server(config)
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: _stop(projector, server))
    serving = asyncio.create_task(server.serve()) if server is not None else None
    try:
        if server is not None:
            while not server.started and not serving.done():  # type: ignore[union-attr]
                await asyncio.sleep(0.02)
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"{NAME}: serving http://{settings.metrics_host}:{port} (/metrics, /healthz, /ui)", flush=True)
        await projector.run()
    except MigrationError as exc:
        fail(NAME, str(exc))
    finally:
        if server is not None and serving is not None:
            server.should_exit = True
            await serving
        if reader is not None:
            await reader.close()


def _stop(projector: Projector, server: uvicorn.Server | None) -> None:
    projector.stop.set()
    if server is not None:
        server.should_exit = True


app = typer_app(__doc__)


@app.command()
def main(
    nats_url: str = typer.Option("nats://127.0.0.1:4222", envvar="NATS_URL", help="NATS server URL."),
    database_url: str = typer.Option(..., envvar="DATABASE_URL", help="Postgres of the read models."),
    stream: str = typer.Option(STREAM_NAME, envvar="ROLLWIRE_STREAM", help="JetStream stream name."),
    host: str = typer.Option("127.0.0.1", "--host", "--metrics-host", help="Address the HTTP port listens on."),
    port: int = typer.Option(
        DEFAULT_PORT,
        "--port",
        "--metrics-port",
        envvar="ROLLWIRE_PROJECTOR_PORT",
        help="HTTP port: queries, /ui, /metrics, /healthz (0: any free port, -1: none).",
    ),
    batch_size: int = typer.Option(1000, min=1, help="Messages per fetch."),
    tokenizer: list[str] = typer.Option(
        [], envvar="ROLLWIRE_TOKENIZERS", help="[MODEL=]tokenizer.json, directory or cached HF repo (repeatable)."
    ),
    admin_token: str = typer.Option(
        "", envvar="ROLLWIRE_ADMIN_TOKEN", help="Bearer token reads need (empty: reads are open)."
    ),
) -> None:
    """Project the stream into Postgres and serve the read side."""
    try:
        access_format()
    except AccessLogError as exc:
        fail(NAME, str(exc))
    settings = ProjectorSettings(
        nats_url=nats_url,
        database_url=database_url,
        stream=stream,
        batch_size=batch_size,
        metrics_host=host,
        metrics_port=None if port < 0 else port,
        tokenizers=[t for spec in tokenizer for t in spec.split(",") if t],
    )
    run_async(serve(settings, admin_token or None))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    run_command(app, NAME, "python -m services.projector")
