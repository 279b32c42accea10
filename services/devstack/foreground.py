"""`rollwire up` in the foreground: start the stack, print its endpoints and `ready`, supervise until a signal.

While it runs, the supervisor (`supervise.py`) restarts dead children and the store watch
(`store_watch.py`) restarts a nats-server whose JetStream store is stuck. SIGINT, SIGTERM and
SIGHUP stop the stack cleanly; SIGKILL takes every child with it (`embedded.die_with_parent`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from services.devstack.stack import Stack, StackConfig
from services.devstack.store_watch import StoreWatch
from services.devstack.supervise import Supervisor


def run_foreground(config: StackConfig, say: Callable[[str], None] = print) -> int:
    """`rollwire up`: start the stack, print its endpoints and `ready`, run until a signal."""
    stopping = False

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stack = Stack(config, say)
    try:
        endpoints = stack.start()
        for line in endpoints.lines:
            say(line)
        say("ready")
        supervisor = Supervisor(stack.units(), say)
        watch = StoreWatch(stack.nats, endpoints.nats_url, say) if stack.nats is not None else None
        while not stopping:
            reason = supervisor.tick()
            if reason is not None:
                say(reason)
                return 1
            if watch is not None:
                watch.tick()
            time.sleep(0.2)
        say("stopping")
        return 0
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
