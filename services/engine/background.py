"""Running an ASGI app (the engine, or any service's app) with uvicorn in a background thread.

For tests and embedded stacks that need a real HTTP server in-process: the server binds a free
loopback port itself (no race between choosing and binding), and `url` is known once started.

    with BackgroundServer(create_app(model_dir)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn


class BackgroundServerError(RuntimeError):
    """The background server did not start; the message says why."""


class BackgroundServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", log_level: str = "warning") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="background-uvicorn", daemon=True
        )

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:41234 (append /v1 for OpenAI clients)."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Start serving; returns once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise BackgroundServerError("the server thread exited during startup (see the log above)")
            if time.monotonic() > deadline:
                raise BackgroundServerError(f"the server did not start within {timeout:.0f}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to shut down (finishing open requests) and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
