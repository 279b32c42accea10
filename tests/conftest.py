"""Shared fixtures: a real nats-server with JetStream and a real PostgreSQL, started from the wheels.

Set NATS_URL / DATABASE_URL to use servers that are already running instead. Tests isolate
themselves by run id (`run_id` fixture), so one stream serves the whole session.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from vllm_server import vllm_model_dir, vllm_server  # noqa: F401  (the session's real vLLM server: tests/vllm_server.py)

from schemas import new_id
from services.common.eventstore import EventStore
from services.devstack.embedded import NatsServer, PostgresServer


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """URL of a JetStream-enabled nats-server shared by the session."""
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
        return
    with tempfile.TemporaryDirectory(prefix="rollwire-nats-") as tmp:
        server = NatsServer(Path(tmp)).start()
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of this test's own (an empty stream, or one the test may stop)."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a PostgreSQL server shared by the session (fsync off: tests need speed, not durability)."""
    if os.environ.get("DATABASE_URL"):
        yield os.environ["DATABASE_URL"]
        return
    with tempfile.TemporaryDirectory(prefix="rollwire-pg-") as tmp:
        server = PostgresServer(Path(tmp), durable=False).start()
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def run_id() -> str:
    """A run id unique to this test, so tests sharing the stream never see each other's events."""
    return new_id("t")


@pytest.fixture
async def store(nats_url: str) -> AsyncIterator[EventStore]:
    """An event store connected to the session's nats-server."""
    es = await EventStore.connect(nats_url)
    try:
        yield es
    finally:
        await es.close()
