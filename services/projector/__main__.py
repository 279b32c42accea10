"""`python -m services.projector`: run the projector until SIGTERM or SIGINT.

    python -m services.projector --nats-url nats://127.0.0.1:4222 \\
        --database-url postgresql://postgres@127.0.0.1:5432/postgres --metrics-port 18090

Settings fall back to the environment (NATS_URL, DATABASE_URL, ROLLWIRE_PROJECTOR_PORT,
ROLLWIRE_TOKENIZERS as a comma-separated list of `[MODEL=]SOURCE`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from schemas.ids import STREAM_NAME
from services.common.accesslog import AccessLogError, access_format
from services.projector.http import serve
from services.projector.migrate import MigrationError
from services.projector.service import Projector, ProjectorSettings, tune_gc
from services.projector.tokens import Detokenizer, TokenizerError

DEFAULT_METRICS_PORT = 18090


def parse_args(argv: list[str] | None = None) -> ProjectorSettings:
    """Settings from the command line and the environment."""
    env = os.environ
    parser = argparse.ArgumentParser(prog="python -m services.projector", description=__doc__.split("\n")[0])
    parser.add_argument("--nats-url", default=env.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--database-url", default=env.get("DATABASE_URL"))
    parser.add_argument("--stream", default=env.get("ROLLWIRE_STREAM") or STREAM_NAME)
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(env.get("ROLLWIRE_PROJECTOR_PORT", DEFAULT_METRICS_PORT)),
        help="port of /metrics and /healthz (0: any free port, -1: none)",
    )
    parser.add_argument("--batch-size", type=int, default=1000, help="messages per fetch")
    parser.add_argument(
        "--tokenizer",
        action="append",
        default=[t for t in env.get("ROLLWIRE_TOKENIZERS", "").split(",") if t],
        help="[MODEL=]tokenizer.json, directory or cached HF repo; decodes ids to text (repeatable)",
    )
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database: pass --database-url or set DATABASE_URL")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    return ProjectorSettings(
        nats_url=args.nats_url,
        database_url=args.database_url,
        stream=args.stream,
        batch_size=args.batch_size,
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        tokenizers=args.tokenizer,
    )


async def main(settings: ProjectorSettings) -> None:
    """Serve metrics, project until a signal arrives, drain and exit."""
    try:
        access_format()
    except AccessLogError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        detok = Detokenizer.from_specs(settings.tokenizers)
    except TokenizerError as exc:
        raise SystemExit(f"error: {exc}") from None
    projector = Projector(settings, detok)
    tune_gc()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, projector.stop.set)
    server = None
    if settings.metrics_port is not None:
        server = await serve(projector.status, settings.metrics_host, settings.metrics_port)
        port = server.sockets[0].getsockname()[1]
        print(f"rollwire projector: metrics on http://{settings.metrics_host}:{port}/metrics", flush=True)
    try:
        await projector.run()
    except MigrationError as exc:
        raise SystemExit(f"error: {exc}") from None
    finally:
        if server is not None:
            server.close()


def run(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` on uvloop when it is installed (less CPU per message), else on asyncio."""
    if importlib.util.find_spec("uvloop"):
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    run(main(parse_args()))
