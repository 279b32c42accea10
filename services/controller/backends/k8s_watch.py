"""The standard controller loop for one Kubernetes collection: list, then watch from the list.

    LIST (paged) ─► hand the snapshot over, remember its resourceVersion
    WATCH from that resourceVersion ─► hand each event over, remember each event's version
      ├─ the watch ends (server timeout, dropped connection): watch again from the last version
      ├─ ERROR 410 Gone (the version is older than the server's history): LIST again
      └─ every `resync_s`: LIST again anyway, which repairs events a broken proxy lost

The official client is synchronous, so the loop runs in a thread of its own and hands results
to its callbacks from that thread (the backend forwards them to its event loop). `stop()` cuts
the open watch connection, so the thread ends promptly instead of at the next event.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

Obj = dict[str, Any]
ListCall = Callable[..., Any]

PAGE_SIZE = 500
READ_GRACE_S = 10.0
"""A watch that stays silent this long past its server-side timeout is presumed dead."""


class WatchGone(Exception):
    """The server no longer has the history the watch asked for (HTTP 410): list again."""


@dataclass
class WatchStats:
    """Counters for tests and metrics: how often the loop listed, watched, hit 410, failed."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    gone: int = 0
    errors: int = 0


def list_all(list_call: ListCall, timeout_s: float, page_size: int = PAGE_SIZE) -> tuple[list[Obj], str]:
    """Every object of a collection (following `continue` pages) and the list's resourceVersion."""
    items: list[Obj] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"limit": page_size, "_preload_content": False, "_request_timeout": timeout_s}
        if token:
            kwargs["_continue"] = token
        body = msgspec.json.decode(list_call(**kwargs).data)
        items.extend(body.get("items") or [])
        meta = body.get("metadata") or {}
        token = meta.get("continue")
        if not token:
            return items, str(meta.get("resourceVersion") or "")


class ListWatch:
    """Keeps one collection in view: `on_list(items)` after every LIST, `on_event(type, obj)` per change."""

    def __init__(
        self,
        *,
        resource: str,
        list_call: ListCall,
        on_list: Callable[[list[Obj]], None],
        on_event: Callable[[str, Obj], None],
        resync_s: float,
        request_timeout_s: float,
    ) -> None:
        self.resource = resource
        self.stats = WatchStats()
        self._list_call = list_call
        self._on_list = on_list
        self._on_event = on_event
        self._resync_s = resync_s
        self._timeout_s = request_timeout_s
        self._stopping = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"rollwire-watch-{resource}", daemon=True)

    def start(self) -> None:
        """Start listing and watching in the background."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop: cut the open watch and wait (up to `timeout_s`) for the thread to end."""
        self._stopping.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()
            except Exception:  # already closed: nothing to cut
                pass
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        delay = _Backoff()
        while not self._stopping.is_set():
            try:
                items, version = list_all(self._list_call, self._timeout_s)
            except Exception as e:
                self._failed("list", e, delay)
                continue
            self.stats.lists += 1
            self._on_list(items)
            delay.reset()
            resync_at = time.monotonic() + self._resync_s
            while not self._stopping.is_set():
                remaining = resync_at - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    version = self._watch(version, remaining)
                    delay.reset()
                except WatchGone:
                    self.stats.gone += 1
                    log.info("watch on %s: resourceVersion %s is gone (410); listing again", self.resource, version)
                    break
                except Exception as e:
                    if self._stopping.is_set():
                        return
                    self._failed("watch", e, delay)

    def _failed(self, what: str, error: Exception, delay: _Backoff) -> None:
        self.stats.errors += 1
        wait = delay.next()
        log.warning("%s of %s failed (%s); retrying in %.1fs", what, self.resource, error, wait)
        self._stopping.wait(wait)

    def _watch(self, version: str, remaining_s: float) -> str:
        """Watch from `version` for about `remaining_s`; return the last version seen."""
        seconds = max(1, math.ceil(remaining_s))
        try:
            response = self._list_call(
                watch=True,
                resource_version=version,
                timeout_seconds=seconds,
                allow_watch_bookmarks=True,
                _preload_content=False,
                _request_timeout=(self._timeout_s, seconds + READ_GRACE_S),
            )
        except ApiException as e:
            if e.status == 410:
                raise WatchGone() from e
            raise
        self.stats.watches += 1
        self._response = response
        if self._stopping.is_set():  # stop() ran before the response was published: nobody cut it
            response.shutdown()
        try:
            for line in _lines(response):
                event = msgspec.json.decode(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchGone()
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind != "BOOKMARK":
                    self.stats.events += 1
                    self._on_event(kind, obj)
                if self._stopping.is_set():
                    break
        finally:
            self._response = None
            response.release_conn()
        return version


def _lines(response: Any) -> Iterator[bytes]:
    """The newline-delimited JSON lines of a streaming watch response, as they arrive."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        yield from (line for line in complete if line.strip())
    if buffer.strip():
        yield buffer


class _Backoff:
    """Exponential retry delay, 0.2 s doubling to 10 s, reset after a success."""

    def __init__(self) -> None:
        self._next = 0.2

    def next(self) -> float:
        current, self._next = self._next, min(self._next * 2, 10.0)
        return current

    def reset(self) -> None:
        self._next = 0.2
