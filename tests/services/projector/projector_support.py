"""Helpers of the projector tests: throwaway databases and a projector running in-process."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import uvicorn
from fastapi import FastAPI

from services.devstack.embedded import free_port
from services.projector.service import Projector, ProjectorSettings


async def create_database(admin_url: str) -> str:
    """A new empty database on the server at `admin_url`; returns its URL."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


async def drop_database(admin_url: str, url: str) -> None:
    """Drop a database made by `create_database` (closing its connections)."""
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
    finally:
        await admin.close()


@contextlib.asynccontextmanager
async def running_projector(nats_url: str, database_url: str, **settings: object) -> AsyncIterator[Projector]:
    """A projector running in this event loop until the block ends (then drained and stopped)."""
    projector = Projector(ProjectorSettings(nats_url=nats_url, database_url=database_url, **settings))  # type: ignore[arg-type]
    task = asyncio.create_task(projector.run())
    try:
        yield projector
    finally:
        projector.stop.set()
        await asyncio.wait_for(task, 30)


async def wait_applied(conn: asyncpg.Connection, seq: int, timeout: float = 30.0, stream: str = "ROLLWIRE") -> None:
    """Wait until the stored position reaches `seq`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            applied = await conn.fetchval("SELECT last_seq FROM projector_position WHERE stream = $1", stream)
        except asyncpg.UndefinedTableError:  # the projector has not migrated yet
            applied = None
        if applied is not None and applied >= seq:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"projection stuck at seq {applied}, waiting for {seq}")
        await asyncio.sleep(0.05)


class ServerThread:
    """A uvicorn server for `app` on a free port, in a thread with its own event loop."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the viewer's server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def gateway_with_projector(
    nats_url: str, database_url: str, admin: str, *, min_seq_timeout_s: float = 10.0, **reader_args: Any
) -> Iterator[ServerThread]:
    """The projector's query app over `database_url`, and a gateway that forwards its reads to it."""
    from services.gateway import GatewaySettings, create_app
    from services.projector.api import create_query_app
    from services.projector.reader import PostgresRolloutReader

    query = create_query_app(
        PostgresRolloutReader(database_url, **reader_args), admin_token=admin, min_seq_timeout_s=min_seq_timeout_s
    )
    with ServerThread(query) as projector:
        settings = GatewaySettings(
            nats_url=nats_url, admin_token=admin, secret="s" * 32, port=free_port(), projector_url=projector.url
        )
        with ServerThread(create_app(settings)) as server:
            yield server
