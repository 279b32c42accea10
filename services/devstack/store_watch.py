"""`rollwire up` restarts a nats-server whose JetStream store stays stuck after a write error.

When the disk fills, JetStream refuses every write with code 10023 ("insufficient resources"),
and it keeps refusing after space comes back, until nats-server restarts. Every `interval_s` the
watch publishes one message to a stream of its own (`HEALTH_STREAM`, one message kept, next to
the events' stream in the same store). When `failures` probes in a row are refused by JetStream
(not a server that cannot be reached: the supervisor restarts dead processes) while the store's
disk has `min_free_bytes` free again, nats-server is restarted, with one line on the console.
A restart that did not help doubles the wait before the next one (up to `MAX_HOLD_S`), so a
store full for another reason (its own limits) does not restart the server in a loop.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable

import nats
import nats.errors
import nats.js.errors
from nats.js.api import StorageType, StreamConfig

from services.devstack.embedded import EmbeddedServerError, NatsServer

HEALTH_STREAM = "ROLLWIRE_STORE_HEALTH"
HEALTH_SUBJECT = "rollwire.store.health"
MAX_HOLD_S = 600.0


async def _quiet(exc: Exception) -> None:
    """nats.py's error callback: the probe's result says what matters, not a traceback per attempt."""


async def _probe(url: str, timeout: float) -> str | None:
    """Why JetStream refused a write just now, or None (written, or the server not reachable at all)."""
    try:
        nc = await nats.connect(
            url, connect_timeout=timeout, max_reconnect_attempts=0, allow_reconnect=False, error_cb=_quiet
        )
    except Exception:  # a server that cannot be reached is the supervisor's business
        return None
    try:
        js = nc.jetstream(timeout=timeout)
        try:
            await js.stream_info(HEALTH_STREAM)
        except nats.js.errors.NotFoundError:
            config = StreamConfig(name=HEALTH_STREAM, subjects=[HEALTH_SUBJECT], max_msgs=1, storage=StorageType.FILE)
            await js.add_stream(config)
        await js.publish(HEALTH_SUBJECT, b"ok", timeout=timeout)
        return None
    except nats.js.errors.APIError as exc:
        return f"code {exc.err_code}: {exc.description}"
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        return f"JetStream does not answer ({type(exc).__name__})"
    finally:
        await nc.close()


class StoreWatch:
    """Probe the JetStream store now and then; restart nats-server when it is stuck (module docstring)."""

    def __init__(
        self,
        server: NatsServer,
        url: str,
        say: Callable[[str], None],
        *,
        interval_s: float = 10.0,
        failures: int = 3,
        min_free_bytes: int = 16 * 2**20,
        timeout_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.server = server
        self.url = url
        self.say = say
        self.interval_s = interval_s
        self.failures = failures
        self.min_free_bytes = min_free_bytes
        self.timeout_s = timeout_s
        self.clock = clock
        self.refused = 0
        self.hold_s = interval_s
        self.next_probe = clock() + interval_s
        self.restarts = 0

    def tick(self) -> None:
        """Probe when due; restart nats-server when the store refused `failures` probes in a row with space free."""
        now = self.clock()
        if now < self.next_probe:
            return
        self.next_probe = now + self.interval_s
        if self.server.proc is None and not self._start():
            return
        reason = asyncio.run(_probe(self.url, self.timeout_s))
        if reason is None:
            self.refused, self.hold_s = 0, self.interval_s
            return
        self.refused += 1
        free = shutil.disk_usage(self.server.data_dir).free
        if self.refused < self.failures or free < self.min_free_bytes:
            return
        self.say(
            f"nats: the JetStream store refuses writes ({reason}) though its disk has {free // 2**20} MB free; "
            f"restarting nats-server (log: {self.server.data_dir / 'nats.log'})"
        )
        self.server.stop()
        self._start()
        self.restarts += 1
        self.refused = 0
        self.next_probe = self.clock() + self.hold_s  # a restart that does not help waits longer each time
        self.hold_s = min(MAX_HOLD_S, self.hold_s * 2)

    def _start(self) -> bool:
        try:
            self.server.start()
        except EmbeddedServerError as exc:
            self.server.proc = None  # tried again at the next probe
            self.say(f"nats-server could not be restarted: {exc}")
            return False
        return True
