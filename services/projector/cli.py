"""`rollwire projector ...`: commands on the read models (mounted by `services.devstack.cli`).

rollwire projector rebuild              # drop every read model; project the stream again
rollwire projector rebuild --run r42    # re-fold one run, in place, in one transaction
rollwire projector status               # position, lag and dead letters
"""

from __future__ import annotations

import asyncio
import os
import time

import asyncpg
import typer

from schemas.ids import STREAM_NAME
from services.common.eventstore import EventStore
from services.projector import pgstore
from services.projector.migrate import MigrationError, migrate

app = typer.Typer(help="The Postgres read models (the projector).", no_args_is_help=True)


class ProjectorCliError(RuntimeError):
    """A projector command cannot run; the message says what to set or start."""


def _urls(nats_url: str | None, database_url: str | None) -> tuple[str, str]:
    nats = nats_url or os.environ.get("NATS_URL")
    database = database_url or os.environ.get("DATABASE_URL")
    if not nats or not database:
        raise ProjectorCliError("set NATS_URL and DATABASE_URL (or pass --nats-url / --database-url)")
    return nats, database


async def _service_running(conn: asyncpg.Connection, stream: str) -> bool:
    """True when a projector holds the stream's lock (it will rebuild by itself)."""
    got = await conn.fetchval("SELECT pg_try_advisory_lock(hashtext('rollwire-projector:' || $1))", stream)
    if got:
        await conn.fetchval("SELECT pg_advisory_unlock(hashtext('rollwire-projector:' || $1))", stream)
    return not got


async def _wait_caught_up(conn: asyncpg.Connection, store: EventStore, stream: str) -> int:
    target = await store.last_sequence()
    while True:
        applied = int(await conn.fetchval("SELECT last_seq FROM projector_position WHERE stream = $1", stream))
        typer.echo(f"\rapplied {applied}/{target}", nl=False, err=True)
        if applied >= target:
            typer.echo("", err=True)
            return applied
        await asyncio.sleep(0.5)


async def _connect(database_url: str) -> asyncpg.Connection:
    try:
        conn = await asyncpg.connect(database_url, timeout=5.0)
        await migrate(conn)
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise ProjectorCliError(f"cannot use Postgres at {database_url}: {exc}") from None
    except MigrationError as exc:
        raise ProjectorCliError(str(exc)) from None
    return conn


async def _rebuild(nats_url: str, database_url: str, stream: str, run: str | None) -> str:
    from services.projector.rebuild import rebuild_run, reset
    from services.projector.service import Projector, ProjectorSettings

    store = await EventStore.connect(nats_url, stream=stream, name="rollwire-projector-cli")
    try:
        conn = await _connect(database_url)
    except BaseException:
        await store.close()
        raise
    try:
        if run is not None:
            started = time.perf_counter()
            folded = await rebuild_run(conn, store, stream, run)
            return f"run {run}: re-folded {folded} events in {time.perf_counter() - started:.1f}s"
        running = await _service_running(conn, stream)
        await reset(conn, stream)
        if running:
            applied = await _wait_caught_up(conn, store, stream)
            return f"read models rebuilt by the running projector up to seq {applied}"
        projector = Projector(ProjectorSettings(nats_url=nats_url, database_url=database_url, stream=stream))
        task = asyncio.create_task(projector.run())
        try:
            applied = await _wait_caught_up(conn, store, stream)
        finally:
            projector.stop.set()
            await task
        return f"read models rebuilt up to seq {applied}"
    finally:
        await conn.close()
        await store.close()


@app.command()
def rebuild(
    run: str | None = typer.Option(None, "--run", help="Re-fold only this run (others are untouched)."),
    nats_url: str | None = typer.Option(None, help="Defaults to $NATS_URL."),
    database_url: str | None = typer.Option(None, help="Defaults to $DATABASE_URL."),
    stream: str = typer.Option(STREAM_NAME, help="The stream the read models follow."),
) -> None:
    """Drop and rebuild the read models from the stream (all of them, or one run's)."""
    nats, database = _urls(nats_url, database_url)
    typer.echo(asyncio.run(_rebuild(nats, database, stream, run)))


async def _status(nats_url: str, database_url: str, stream: str) -> str:
    store = await EventStore.connect(nats_url, stream=stream, name="rollwire-projector-cli")
    try:
        conn = await _connect(database_url)
    except BaseException:
        await store.close()
        raise
    try:
        applied = await pgstore.ensure_position(conn, stream)
        last = await store.last_sequence()
        dead = await pgstore.dead_letter_count(conn)
        running = await _service_running(conn, stream)
        return (
            f"stream {stream}: last seq {last}, applied {applied}, lag {max(0, last - applied)} events, "
            f"{dead} dead letters; projector {'running' if running else 'not running'}"
        )
    finally:
        await conn.close()
        await store.close()


@app.command()
def status(
    nats_url: str | None = typer.Option(None, help="Defaults to $NATS_URL."),
    database_url: str | None = typer.Option(None, help="Defaults to $DATABASE_URL."),
    stream: str = typer.Option(STREAM_NAME, help="The stream the read models follow."),
) -> None:
    """Where the projection stands: applied position, lag, dead letters."""
    nats, database = _urls(nats_url, database_url)
    typer.echo(asyncio.run(_status(nats, database, stream)))
