"""Shared names of the engine tests (a module of its own: `conftest` is ambiguous across test folders)."""

from __future__ import annotations

from services.engine.background import BackgroundServer
from services.engine.engine import Engine

SERVED_NAME = "tiny-test"
MAX_MODEL_LEN = 1024


class EngineHandle:
    """A served engine: its base URL and the in-process Engine behind it."""

    def __init__(self, server: BackgroundServer, engine: Engine) -> None:
        self.url = server.url
        self.engine = engine
