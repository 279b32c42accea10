"""Helpers for the replay, monitor, tail and export tests: publish events, run the CLI in-process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import msgspec
import pytest
from typer.testing import CliRunner

from schemas import Event
from services.common.eventstore import EventStore
from services.devstack.cli import app


class CliResult(msgspec.Struct, frozen=True):
    """What a `rollwire` command printed and its exit code."""

    exit_code: int
    stdout: str
    stderr: str


def publish(nats_url: str, events: Sequence[Event]) -> None:
    """Append events to the session's stream (from a synchronous test)."""

    async def go() -> None:
        store = await EventStore.connect(nats_url)
        try:
            for i in range(0, len(events), 2000):
                await store.append_many(events[i : i + 2000])
        finally:
            await store.close()

    asyncio.run(go())


@pytest.fixture
def rollwire(nats_url: str) -> Callable[..., CliResult]:
    """Run `rollwire ARGS...` in-process against the session's NATS server."""
    runner = CliRunner()

    def run(*args: str) -> CliResult:
        result = runner.invoke(app, list(args), env={"NATS_URL": nats_url}, catch_exceptions=False)
        return CliResult(result.exit_code, result.stdout, result.stderr)

    return run
