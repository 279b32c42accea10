"""An ASGI app (a gateway, a fake upstream, any service's app) served by uvicorn on a free port in a thread.

For tests that need a real HTTP server in-process:

    with Served(create_app(settings)) as server:
        client = httpx.Client(base_url=server.url)
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from services.devstack.embedded import free_port


class Served:
    """An ASGI app served by uvicorn on a free port in a background thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            http="httptools",
            loop="asyncio",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server for {self.app!r} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
