"""`python -m services.gateway`: run the gateway (rollout API, proxy, phase gate, reads) until SIGTERM.

Every flag falls back to its environment variable (see `--help`; the rest of the settings are
read from the environment, `settings.py`). Exits 2 with a one-line reason when a setting is
unusable or NATS cannot be reached, 0 after a clean shutdown on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import msgspec
import typer
import uvicorn

from services.common.accesslog import AccessLogError, access_format
from services.common.eventstore import EventStore, EventStoreError
from services.common.gctune import tune_gc
from services.common.headheld import OneSendProtocol
from services.common.settings import fail, run_async, run_command, typer_app
from services.gateway.app import create_app
from services.gateway.proxy.reaper import require_msg_ttl
from services.gateway.settings import DEFAULT_PORT, GatewaySettings, SettingsError, settings_from_env

NAME = "rollwire gateway"


async def _check_nats(settings: GatewaySettings) -> None:
    store = await EventStore.connect(settings.nats_url, stream=settings.stream)
    try:
        require_msg_ttl(store.nc)
    finally:
        await store.close()


async def serve(settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn drains open requests, then the app disconnects from NATS)."""
    try:
        await _check_nats(settings)
    except EventStoreError as exc:
        fail(NAME, str(exc))
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        http=OneSendProtocol,  # one socket send per response (see headheld.py)
        proxy_headers=False,  # nothing reads a forwarded client address; not parsed on every call
        timeout_keep_alive=120,
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    tune_gc()  # the app and its modules are built: frozen out of the collector's scans
    # Our own handlers: uvicorn's would re-raise the signal after shutdown (exit status -15).
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    await server.serve()


app = typer_app(__doc__)


@app.command()
def main(
    host: str = typer.Option("127.0.0.1", envvar="ROLLWIRE_GATEWAY_HOST", help="Address to listen on."),
    port: int = typer.Option(DEFAULT_PORT, envvar="ROLLWIRE_GATEWAY_PORT", help="Port to listen on."),
    nats_url: str = typer.Option("nats://127.0.0.1:4222", envvar="NATS_URL", help="NATS server URL."),
    public_url: str = typer.Option("", envvar="ROLLWIRE_PUBLIC_URL", help="URL agents use to reach the gateway."),
    projector_url: str = typer.Option(
        "", envvar="ROLLWIRE_PROJECTOR_URL", help="The projector's HTTP URL; reads go there (empty: fold the stream)."
    ),
) -> None:
    """Run the gateway."""
    try:
        settings = msgspec.structs.replace(
            settings_from_env(),
            host=host,
            port=port,
            nats_url=nats_url,
            public_url=public_url,
            projector_url=projector_url,
        )
        access_format()
    except (SettingsError, AccessLogError) as exc:
        fail(NAME, str(exc))
    run_async(serve(settings))


if __name__ == "__main__":
    run_command(app, NAME, "python -m services.gateway")
