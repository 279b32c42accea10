"""Plain ASGI helpers for the proxy's hot path: headers, bodies, JSON answers, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from services.gateway.errors import ApiError, invalid, retry_headers, too_large

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def send_json(send: Send, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
    """A complete JSON response with its length (a permanent refusal says `x-should-retry: false`)."""
    extra = [(k.lower().encode(), v.encode()) for k, v in (retry_headers(status) | (headers or {})).items()]
    length = (b"content-length", b"%d" % len(payload))
    await send({"type": "http.response.start", "status": status, "headers": [*JSON_HEADERS, length, *extra]})
    await send({"type": "http.response.body", "body": payload})


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (names are lower-case in ASGI)."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; 413 past `limit` bytes (checked on the declared length first)."""
    declared = header(scope, b"content-length")
    if declared is not None and not declared.isdigit():
        raise invalid("Content-Length is not a number", "content-length")
    if declared is not None and int(declared) > limit:
        raise too_large(limit)
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(499, "the client disconnected before sending its request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def disconnected(receive: Receive) -> None:
    """Return when the client goes away (the request body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


WATCH_AFTER_S = 0.05
"""A call starts watching for its client's disconnect once it has taken this long: a task per call
costs more than the rest of a fast call's answer, and a client gone this early only lets the engine
generate this much longer."""


class DisconnectWatch:
    """Cancels the task that makes it when its client goes away, once the call outlasts `WATCH_AFTER_S`.

        watch = DisconnectWatch(receive)
        try:
            ...                                  # the engine's answer, relayed or read
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            asyncio.current_task().uncancel()    # the client left: record the call as aborted
        finally:
            watch.stop()

    Cancelling the task closes the engine's connection, which is how the engine learns to stop.
    """

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.receive = receive
        self.gone = False
        self._watcher: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        await disconnected(self.receive)
        self.gone = True
        self.task.cancel()

    def stop(self) -> None:
        """Stop watching (the call's answer is in, or it failed)."""
        self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
