"""Schema migrations of the read models: plain SQL files applied in order, once each.

`migrations/NNN_name.sql` are applied in ascending `NNN`, each in its own transaction together with
its row in `schema_migrations`, under an advisory lock so that a projector and a gateway starting
at the same time do not both apply one. A database that has a version this code does not know is
refused: an older binary must not write into a newer schema.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import NamedTuple

import asyncpg

MIGRATIONS_PACKAGE = "services.projector.migrations"
_LOCK_KEY = 0x526F6C6C77697265  # "Rollwire" as a 64-bit advisory lock key
_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


class MigrationError(RuntimeError):
    """The database schema cannot be brought to this version; the message says what to do."""


class Migration(NamedTuple):
    """One SQL file: its version number, name and text."""

    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """Every migration shipped with this package, in version order."""
    found: list[Migration] = []
    for entry in resources.files(MIGRATIONS_PACKAGE).iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration versions must be 1..n without gaps, found {versions}")
    return found


async def applied_versions(conn: asyncpg.Connection) -> list[int]:
    """Versions recorded in `schema_migrations` (empty when the table does not exist)."""
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    if not exists:
        return []
    return [row[0] for row in await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")]


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Apply every pending migration; returns the versions applied now (empty when up to date)."""
    known = migrations()
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = set(await applied_versions(conn))
        newer = sorted(v for v in done if v > len(known))
        if newer:
            raise MigrationError(
                f"the database has read-model schema version {max(newer)} but this Rollwire knows only "
                f"{len(known)}: upgrade Rollwire, or point DATABASE_URL at another database"
            )
        applied: list[int] = []
        for migration in known:
            if migration.version in done:
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", migration.version, migration.name
                )
            applied.append(migration.version)
        return applied
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)


async def is_current(conn: asyncpg.Connection) -> bool:
    """True when every shipped migration is applied."""
    return set(await applied_versions(conn)) >= {m.version for m in migrations()}
