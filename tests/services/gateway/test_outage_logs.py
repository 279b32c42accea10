"""A NATS outage is logged as one clear line per service, and one when NATS answers again, not tracebacks.

The gateway, the projector and the controller run as real processes on a nats-server of the
test's own, which is killed for 5 s and started again. Before, each service logged about two
tracebacks a second while it was down (nats-py's default error callback, on every reconnect attempt).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import asyncpg
import pytest
from gw_harness import ADMIN
from test_reaper import _start_gateway

from services.devstack.embedded import NatsServer, free_port

OUTAGE_S = 5.0


async def _database(pg_url: str) -> str:
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return pg_url.rsplit("/", 1)[0] + f"/{name}"


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    out = open(log, "wb")
    return subprocess.Popen([sys.executable, "-m", *args], env={**os.environ, **env}, stdout=out, stderr=out)


def _ready(log: Path, proc: subprocess.Popen[bytes], line: str) -> None:
    """Wait for a service's start line (it is connected by then)."""
    deadline = time.monotonic() + 60
    while line not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.1)


@pytest.mark.slow
def test_each_service_logs_an_outage_once_and_its_end_once(fresh_nats: NatsServer, pg_url: str, tmp_path: Path) -> None:
    import asyncio

    database = asyncio.run(_database(pg_url))
    port = free_port()
    gateway = _start_gateway(fresh_nats.url, port, tmp_path)
    env = {
        "NATS_URL": fresh_nats.url,
        "ROLLWIRE_ADMIN_TOKEN": ADMIN,
        "ROLLWIRE_GATEWAY_URL": f"http://127.0.0.1:{port}",
    }
    logs = {"gateway": tmp_path / "gateway.log", "projector": tmp_path / "projector.log",
            "controller": tmp_path / "controller.log"}  # fmt: skip
    projector = _spawn(["services.projector", "--nats-url", fresh_nats.url, "--database-url", database,
                        "--port", "0"], logs["projector"], env)  # fmt: skip
    controller = _spawn(["services.controller", "--data-dir", str(tmp_path / "ctl"), "--metrics-port", "0"],
                        logs["controller"], env)  # fmt: skip
    services = {"gateway": gateway, "projector": projector, "controller": controller}
    try:
        _ready(logs["projector"], projector, "serving http://")
        _ready(logs["controller"], controller, "metrics on http://")
        time.sleep(2.0)  # all three connected and following the stream
        for name, proc in services.items():
            assert proc.poll() is None, f"{name} exited: {logs[name].read_text()[-2000:]}"
        marks = {name: len(log.read_bytes()) for name, log in logs.items()}
        assert fresh_nats.proc is not None
        fresh_nats.proc.send_signal(signal.SIGKILL)
        fresh_nats.proc.wait()
        fresh_nats.proc = None
        time.sleep(OUTAGE_S)
        fresh_nats.start()
        time.sleep(4.0)  # reconnected, and past a few retry periods of each service
        during = {name: log.read_bytes()[marks[name] :].decode(errors="replace") for name, log in logs.items()}
    finally:
        for proc in services.values():
            proc.send_signal(signal.SIGTERM)
        for proc in services.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary = {name: (text.count("Traceback"), len(text.splitlines())) for name, text in during.items()}
    print(f"\n{OUTAGE_S:g} s NATS outage, (tracebacks, log lines) per service: {summary}")
    for name, text in during.items():
        lines = [line for line in text.splitlines() if "access " not in line]
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
        assert len(lines) <= 6, f"{name} logged {len(lines)} lines:\n" + "\n".join(lines)
        assert any("unavailable" in line for line in lines), f"{name}:\n{text}"
        assert any("answers again" in line for line in lines), f"{name}:\n{text}"


async def test_a_store_closed_on_purpose_reports_no_outage_and_a_dropped_one_does(
    fresh_nats: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """`close()` also runs nats-py's disconnect callback: that is not an outage (a run's last line said
    "NATS unavailable (reconnecting)" as it finished); a server that goes away still is one."""
    from services.common.eventstore import EventStore

    caplog.set_level("WARNING", logger="rollwire.eventstore")
    store = await EventStore.connect(fresh_nats.url)
    await store.close()
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == []

    dropped = await EventStore.connect(fresh_nats.url)
    try:
        fresh_nats.stop()
        for _ in range(50):
            if any("unavailable" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.1)
        assert any("unavailable" in r.getMessage() for r in caplog.records)
    finally:
        await dropped.close()
