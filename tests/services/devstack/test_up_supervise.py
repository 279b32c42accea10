"""`rollwire up` as a supervisor (issue: when any child died it stopped everything and exited 1).

A child killed with SIGKILL (a service, nats-server itself) comes back with a console line and the
stack keeps serving; a child that fails fast again and again stops the stack with the reason.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

ROLLWIRE = [sys.executable, "-m", "services.devstack.cli"]


class Up:
    """A `rollwire up` process whose console lines are read in the background."""

    def __init__(self, data_dir: Path, services: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*ROLLWIRE, "up", "--data-dir", str(data_dir), "--nats-port", "0", "--pg-port", "0",
             "--gateway-port", "0", "--services", services],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_for(self, text: str, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.append(line)
            print(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} within {timeout}s; saw {seen}")

    def child(self, needle: str) -> psutil.Process:
        for proc in psutil.Process(self.proc.pid).children():
            if needle in " ".join(proc.cmdline()):
                return proc
        raise AssertionError(f"no child process matching {needle!r}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(60)
        self.reader.join(10)
        rest = []
        while not self.lines.empty():
            rest.append(self.lines.get())
        print("\n".join(rest))  # shown when a test fails
        return code


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_killed_children_are_restarted(tmp_path: Path) -> None:
    up = Up(tmp_path / "d", "projector")
    try:
        projector_line = up.wait_for("projector: ")
        up.wait_for("ready")
        health = projector_line.split(": ", 1)[1].replace("/metrics", "/healthz")
        first = up.child("services.projector")
        first.kill()
        assert "restarting in" in up.wait_for("projector exited with code -9")
        up.wait_for("projector restarted")
        assert up.child("services.projector").pid != first.pid
        deadline = time.monotonic() + 60
        while not _healthy(health):  # it serves again, unattended
            assert time.monotonic() < deadline, "the restarted projector never became healthy"
            time.sleep(0.5)
        up.child("nats-server").kill()
        up.wait_for("nats exited with code -9")
        up.wait_for("nats restarted")
        assert up.proc.poll() is None
    finally:
        assert up.stop() == 0


def test_repeated_fast_failure_stops_the_stack_with_the_reason(tmp_path: Path) -> None:
    up = Up(tmp_path / "d", "projector,gateway,controller")  # the controller needs the gateway
    try:
        up.wait_for("ready")
        reason = ""
        for _ in range(8):  # a child that dies again as soon as it is back (the first kill may count as slow)
            up.child("services.controller").kill()
            line = up.wait_for("controller ", timeout=60)
            while "times in a row" not in line and "restarted" not in line:
                line = up.wait_for("controller ", timeout=60)
            if "times in a row" in line:
                reason = line
                break
        assert reason.startswith("controller exited with code -9 5 times in a row") and "controller.log" in reason
        assert up.proc.wait(60) == 1
    finally:
        up.stop()
