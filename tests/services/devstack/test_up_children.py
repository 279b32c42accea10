"""`rollwire up` leaves nothing behind however it dies, and a second one on its data dir says who holds it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_up import ROLLWIRE, start_up


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Outside pytest's base directory, which any pytest starting as this user resets to 0700 (as root,
    Postgres runs as its own user and must traverse to its data dir)."""
    path = Path(tempfile.mkdtemp(prefix="rollwire-up-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still running (zombies aside) after `timeout`."""
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_children_die_with_rollwire_up(tmp_path: Path, sig: signal.Signals) -> None:
    proc, _ = start_up(tmp_path / "stack")
    children = [c.pid for c in psutil.Process(proc.pid).children()]
    assert len(children) >= 2  # nats-server and Postgres
    proc.send_signal(sig)
    proc.wait(30)
    assert _gone(children) == []
    again, _ = start_up(tmp_path / "stack")  # the data dir is free again
    again.send_signal(signal.SIGINT)
    assert again.wait(30) == 0


def test_a_second_up_on_the_same_data_dir_names_the_running_stack(tmp_path: Path) -> None:
    proc, _ = start_up(tmp_path / "stack")
    try:
        second = subprocess.run(
            [*ROLLWIRE, "up", "--data-dir", str(tmp_path / "stack"), "--nats-port", "0", "--pg-port", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2
        assert f"in use by another running stack (`rollwire up`, pid {proc.pid}" in second.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_a_stopped_stack_leaves_nothing_in_a_childs_process_group(tmp_path: Path) -> None:
    """A service that exits on SIGTERM while processes it started keep running in its group (as vLLM's API
    server may leave its engine core and workers) takes them with it when the stack stops."""
    from services.devstack.stack import Stack
    from services.devstack.stack_config import ChildService, StackConfig

    leaver = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "print(child.pid, flush=True)\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "time.sleep(300)\n"
    )
    stack = Stack(StackConfig(data_dir=tmp_path / "stack"))
    stack.data_dir.mkdir(parents=True)
    service = ChildService("leaver", [], command=[sys.executable, "-c", leaver])
    stack._spawn(service, dict(os.environ))
    stack.children.append(service)
    log = stack.data_dir / "logs" / "leaver.log"
    for _ in range(100):
        if log.exists() and log.read_text().strip():
            break
        time.sleep(0.1)
    left = int(log.read_text().split()[0])
    assert psutil.pid_exists(left)
    stack.stop()
    assert _gone([left], timeout=5) == []
