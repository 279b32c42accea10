"""A JetStream store stuck after its disk filled is noticed and nats-server restarted, once space is back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.js.errors
import pytest

from services.devstack.embedded import NatsServer
from services.devstack.store_watch import StoreWatch


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 24 MB tmpfs (root only: mounting one is how a test gets a disk that fills)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path = Path(tempfile.mkdtemp(prefix="rollwire-full-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])
        path.rmdir()


async def _fill(url: str) -> str:
    """Publish 1 MB events until the store refuses one; the refusal's error."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="EVENTS", subjects=["e.>"])
    try:
        for _ in range(100):
            await js.publish("e.x", os.urandom(1_000_000), timeout=5)
    except nats.js.errors.APIError as exc:
        return f"{exc.err_code}"
    finally:
        await nc.close()
    raise AssertionError("the disk never filled")


async def _write(url: str) -> str:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().publish("e.x", b"small", timeout=5)
        return "ok"
    except nats.js.errors.APIError as exc:
        return f"{exc.err_code}"
    finally:
        await nc.close()


def test_a_store_stuck_after_a_full_disk_is_restarted_once_space_returns(small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 6_000_000)
    server = NatsServer(small_disk / "nats").start()
    lines: list[str] = []
    now = [0.0]
    watch = StoreWatch(server, server.url, lines.append, interval_s=1.0, failures=2, min_free_bytes=4 * 2**20,
                       clock=lambda: now[0])  # fmt: skip
    try:
        assert asyncio.run(_fill(server.url)) == "10023"
        for _ in range(3):  # full: refused, but no restart while there is no space
            now[0] += 1
            watch.tick()
        assert watch.restarts == 0
        filler.unlink()  # space is back; the store stays stuck on its own
        assert asyncio.run(_write(server.url)) == "10023"
        for _ in range(2):
            now[0] += 1
            watch.tick()
        assert watch.restarts == 1, lines
        assert "restarting nats-server" in lines[-1] and "10023" in lines[-1]
        assert asyncio.run(_write(server.url)) == "ok"
        now[0] += 1
        watch.tick()  # healthy again: no further restart
        assert watch.restarts == 1
    finally:
        server.stop()
