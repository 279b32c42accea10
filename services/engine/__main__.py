"""Run the embedded engine: `python -m services.engine --model DIR --port P`.

Without --model it serves the tiny default model (built on first use, see services.engine.tiny_model).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import uvicorn

from services.common.accesslog import AccessLogError, access_format
from services.engine.server import create_app
from services.engine.tiny_model import ensure_tiny_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the engine."""
    parser = argparse.ArgumentParser(prog="python -m services.engine", description="Rollwire embedded CPU engine.")
    parser.add_argument("--model", type=Path, help="saved model directory (default: the tiny default model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-name", help="model name clients use (default: the model directory's name)")
    parser.add_argument("--seed", type=int, help="seed for requests that give none (default: random)")
    parser.add_argument("--weights-version", type=int, default=0, help="version of the weights served at start")
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's max positions)")
    parser.add_argument("--threads", type=int, help="torch threads for generation (default: 1 for small models)")
    return parser.parse_args(argv)


async def main(argv: list[str] | None = None) -> None:
    """Load the model and serve until SIGINT/SIGTERM (uvicorn finishes open requests first)."""
    args = parse_args(argv)
    try:
        access_format()
    except AccessLogError as exc:
        raise SystemExit(f"rollwire engine: {exc}") from None
    model_dir = args.model if args.model is not None else ensure_tiny_model()
    app = create_app(
        model_dir,
        served_name=args.served_name,
        seed=args.seed,
        weights_version=args.weights_version,
        max_model_len=args.max_model_len,
        threads=args.threads,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False))
    await server.serve()


if __name__ == "__main__":
    asyncio.run(main())
