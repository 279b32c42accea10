"""The quickstart's agent fork server goes with the run that started it, however the run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HOLDER = """
import sys, time
from trainer.quickstart.run import fork_server
with fork_server() as command:
    import psutil
    print([c.pid for c in psutil.Process().children()][0], flush=True)
    time.sleep(300)
"""


def test_a_killed_run_leaves_no_fork_server() -> None:
    run = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.stdout is not None
    server = int(run.stdout.readline())
    os.kill(server, 0)  # running
    run.send_signal(signal.SIGKILL)
    run.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return  # dead, waiting to be reaped
        time.sleep(0.1)
    os.kill(server, signal.SIGKILL)
    raise AssertionError("the fork server outlived the run that started it")
