"""`python -m services.gateway [--host H] [--port P] [--nats-url URL]`: run the gateway until SIGTERM.

Settings come from the environment (see `settings.py`); the flags override them. Exits 2 with a
one-line reason when NATS cannot be reached, 0 after a clean shutdown on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import signal
import sys

import msgspec
import uvicorn

from services.common.accesslog import AccessLogError, access_format
from services.common.eventstore import EventStore, EventStoreError
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings, SettingsError, settings_from_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (each overrides its environment variable)."""
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    parser.add_argument("--host", help="address to listen on (ROLLWIRE_GATEWAY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (ROLLWIRE_GATEWAY_PORT, default 8080)")
    parser.add_argument("--nats-url", help="NATS server URL (NATS_URL)")
    parser.add_argument("--public-url", help="URL agents use to reach the gateway (ROLLWIRE_PUBLIC_URL)")
    parser.add_argument("--database-url", help="Postgres of the projector; GET endpoints read it (DATABASE_URL)")
    return parser.parse_args(argv)


def build_settings(args: argparse.Namespace) -> GatewaySettings:
    """Environment settings with the flags applied."""
    settings = settings_from_env()
    changes = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "nats_url": args.nats_url,
            "public_url": args.public_url,
        }.items()
        if v is not None
    }
    return msgspec.structs.replace(settings, **changes) if changes else settings


async def _check_nats(settings: GatewaySettings) -> None:
    store = await EventStore.connect(settings.nats_url, stream=settings.stream)
    await store.close()


async def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT (uvicorn drains open requests, then the app disconnects from NATS)."""
    try:
        args = parse_args(argv)
        settings = build_settings(args)
        access_format()
    except (SettingsError, AccessLogError) as exc:
        print(f"rollwire gateway: {exc}", file=sys.stderr)
        return 2
    try:
        await _check_nats(settings)
    except EventStoreError as exc:
        print(f"rollwire gateway: {exc}", file=sys.stderr)
        return 2
    database_url = args.database_url or os.environ.get("DATABASE_URL")
    if database_url:  # queries are answered from the projector's read models, not by folding the stream
        from services.projector.api import install_read_side
        from services.projector.reader import PostgresRolloutReader

        reader = PostgresRolloutReader(database_url, stream=settings.stream)
        app = create_app(settings, reader=reader)
        install_read_side(app, reader, authorize=lambda request: request.app.state.gateway.admin(request))
    else:
        app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
        timeout_keep_alive=120,
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    # Our own handlers: uvicorn's would re-raise the signal after shutdown (exit status -15).
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    await server.serve()
    return 0


def run() -> None:
    """Entry point: uvloop when installed, else asyncio."""
    if importlib.util.find_spec("uvloop"):
        import uvloop

        sys.exit(uvloop.run(main()))
    sys.exit(asyncio.run(main()))


if __name__ == "__main__":
    run()
