"""Fixtures of the projector tests: a fresh database per test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
from projector_support import create_database, drop_database

from services.projector.migrate import migrate
from services.projector.reader import PostgresRolloutReader


@pytest.fixture
def database(pg_url: str) -> Iterator[str]:
    """URL of a fresh database of this test's own, migrated."""
    url = asyncio.run(create_database(pg_url))

    async def prepare() -> None:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn)
        finally:
            await conn.close()

    asyncio.run(prepare())
    try:
        yield url
    finally:
        asyncio.run(drop_database(pg_url, url))


@pytest.fixture
async def conn(database: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to the test's database."""
    connection = await asyncpg.connect(database)
    try:
        yield connection
    finally:
        await connection.close()


@pytest.fixture
async def reader(database: str) -> AsyncIterator[PostgresRolloutReader]:
    """The Postgres reader over the test's database."""
    r = PostgresRolloutReader(database)
    try:
        yield r
    finally:
        await r.close()
