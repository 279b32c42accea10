"""An agent that takes a while: appends its attempt id to a shared file, waits, reports a reward.

Used to check that a controller restart neither starts an attempt twice nor forgets one.
Input: {"starts_file": path, "seconds": float} or {"starts_file": path, "gate": path} (it then
waits until the gate file exists, at most a minute).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from services import agentkit


def main() -> None:
    """Record the start, wait, report 1.0."""
    task = agentkit.read_input()
    with open(task["starts_file"], "a", encoding="utf-8") as handle:
        handle.write(os.environ["ROLLWIRE_ATTEMPT_ID"] + "\n")
    if task.get("gate"):
        deadline = time.monotonic() + 60
        while not Path(task["gate"]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        time.sleep(float(task.get("seconds", 0)))
    agentkit.report_reward(1.0)


if __name__ == "__main__":
    main()
