"""An agent that hangs, with a child process in its group; its input names a file for its process group id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def main() -> None:
    """Start a sleeping child, record the process group, and never finish."""
    task = json.loads(os.environ["ROLLWIRE_INPUT"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(task["pid_file"], "w", encoding="utf-8") as handle:
        json.dump({"pgid": os.getpgid(0), "pid": os.getpid(), "child": child.pid}, handle)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
