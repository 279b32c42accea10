"""The gateway under cProfile, for `bench_proxy.py --profile DIR`: profile between two signals.

    python bench/profiled_gateway.py DIR [gateway options]

Runs `python -m services.gateway` in this process. SIGUSR1 starts a fresh profile; SIGUSR2 stops
it and writes it to `DIR/<n>.prof` (n counts from 0), so the bench profiles each measured case
alone, without start-up, warm-up or the cases between. `proxy_stages.py` turns the files into
the per-stage table.
"""

from __future__ import annotations

import cProfile
import signal
import sys
import time
from pathlib import Path
from types import FrameType

_state: dict[str, object] = {"profile": None, "count": 0}


def _start(signum: int, frame: FrameType | None) -> None:
    profile = cProfile.Profile(time.process_time)  # CPU time: a loaded machine's waits are not counted
    _state["profile"] = profile
    profile.enable()


def _stop(signum: int, frame: FrameType | None) -> None:
    profile = _state["profile"]
    if isinstance(profile, cProfile.Profile):
        profile.disable()
        count = int(str(_state["count"]))
        profile.dump_stats(str(Path(sys.argv[0]).parent / f"{count}.prof"))
        _state["count"], _state["profile"] = count + 1, None


def main() -> None:
    """Install the two signal handlers, then run the gateway's command line."""
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    sys.argv = [str(out / "gateway"), *sys.argv[2:]]
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    from services.common.settings import run_command
    from services.gateway.__main__ import NAME, app

    run_command(app, NAME, "python -m services.gateway")


if __name__ == "__main__":
    main()
