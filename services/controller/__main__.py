"""`python -m services.controller [--gateway-url URL] [--nats-url URL] [--admin-token T]`: run until SIGTERM.

Flags override the environment (ROLLWIRE_GATEWAY_URL, NATS_URL, ROLLWIRE_ADMIN_TOKEN, ...; see
`settings.py`). Exits 2 with a one-line reason when a setting is wrong or NATS or the gateway
cannot be reached, and 0 after SIGTERM or SIGINT: it stops starting executions, lets commands
in flight finish, and leaves running executions to the next controller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time

from services.common import httpserve
from services.common.accesslog import AccessLogError, access_format
from services.common.eventstore import EventStore, EventStoreError
from services.common.gateway_api import GatewayClient
from services.common.settings import run_async
from services.controller.reconciler import Controller
from services.controller.settings import ControllerSettings, SettingsError, parse

GATEWAY_WAIT_S = 60.0


async def main(argv: list[str] | None = None) -> int:
    """Connect, wait for the gateway, reconcile until a signal."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rollwire").setLevel(os.environ.get("ROLLWIRE_LOG_LEVEL", "INFO").upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        settings = parse(sys.argv[1:] if argv is None else argv)
        access_format()
    except (SettingsError, AccessLogError) as exc:
        print(f"rollwire controller: {exc}", file=sys.stderr)
        return 2
    try:
        store = await EventStore.connect(settings.nats_url, stream=settings.stream, name="rollwire-controller")
    except EventStoreError as exc:
        print(f"rollwire controller: {exc}", file=sys.stderr)
        return 2
    gateway = GatewayClient(settings.gateway_url, settings.admin_token, timeout=30.0)
    try:
        deadline = time.monotonic() + GATEWAY_WAIT_S
        while not await gateway.healthy():
            if time.monotonic() > deadline:
                print(
                    f"rollwire controller: no gateway answers at {settings.gateway_url}/healthz; "
                    "start it (rollwire up) or fix ROLLWIRE_GATEWAY_URL",
                    file=sys.stderr,
                )
                return 2
            await asyncio.sleep(0.5)
        controller = Controller(store, gateway, settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, controller.stop)
        server = await _serve_metrics(settings, controller, store)
        try:
            await controller.run()
        finally:
            if server is not None:
                server.close()
        return 0
    finally:
        await gateway.close()
        await store.close()


async def _serve_metrics(
    settings: ControllerSettings, controller: Controller, store: EventStore
) -> asyncio.Server | None:
    """`/metrics` and `/healthz` on the configured port (none when no port is set)."""
    if settings.metrics_port is None:
        return None

    def health() -> tuple[int, bytes]:
        ok = controller.started.is_set() and store.nc.is_connected
        nats, started = store.nc.is_connected, controller.started.is_set()
        body = {"status": "ok" if ok else "degraded", "nats": nats, "started": started}
        return (200 if ok else 503), json.dumps(body).encode()

    server = await httpserve.serve("controller", settings.metrics_host, settings.metrics_port, health)
    port = server.sockets[0].getsockname()[1]
    print(f"rollwire controller: metrics on http://{settings.metrics_host}:{port}/metrics", flush=True)
    return server


def run() -> None:
    """Console entry point."""
    sys.exit(run_async(main()))


if __name__ == "__main__":
    run()
