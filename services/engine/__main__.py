"""Run the embedded engine: `python -m services.engine --model DIR --port P`.

Without --model it serves the tiny default model (built on first use, see services.common.tinymodel.build).
Every flag falls back to its environment variable (see `--help`).
"""

from __future__ import annotations

from pathlib import Path

import typer
import uvicorn

from services.common.accesslog import AccessLogError, access_format
from services.common.settings import fail, run_async, run_command, typer_app
from services.common.tinymodel.build import ensure_tiny_model
from services.engine.server import create_app

app = typer_app(__doc__)


async def serve(model_dir: Path | None, host: str, port: int, **options: object) -> None:
    """Load the model and serve until SIGINT/SIGTERM (uvicorn finishes open requests first)."""
    model = model_dir if model_dir is not None else ensure_tiny_model()
    config = uvicorn.Config(create_app(model, **options), host=host, port=port, log_level="info", access_log=False)  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    await server.serve()


@app.command()
def main(
    model: Path | None = typer.Option(
        None, envvar="ROLLWIRE_ENGINE_MODEL", help="Saved model directory (default: the tiny default model)."
    ),
    host: str = typer.Option("127.0.0.1", envvar="ROLLWIRE_ENGINE_HOST", help="Address to listen on."),
    port: int = typer.Option(8000, envvar="ROLLWIRE_ENGINE_PORT", help="Port to listen on."),
    served_name: str | None = typer.Option(None, help="Model name clients use (default: the model directory's name)."),
    seed: int | None = typer.Option(None, help="Seed for requests that give none (default: random)."),
    weights_version: int = typer.Option(0, help="Version of the weights served at start."),
    max_model_len: int | None = typer.Option(None, help="Context limit (default: the model's max positions)."),
    threads: int | None = typer.Option(None, help="Torch threads for generation (default: 1 for small models)."),
) -> None:
    """Serve the engine."""
    try:
        access_format()
    except AccessLogError as exc:
        fail("rollwire engine", str(exc))
    run_async(
        serve(
            model,
            host,
            port,
            served_name=served_name,
            seed=seed,
            weights_version=weights_version,
            max_model_len=max_model_len,
            threads=threads,
        )
    )


if __name__ == "__main__":
    run_command(app, "rollwire engine", "python -m services.engine")
