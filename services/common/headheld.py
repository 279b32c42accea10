"""uvicorn's HTTP protocol (httptools) sending a response's head and its body in one socket send.

uvicorn writes a response's status line and headers, then its body, each with its own
`transport.write`, and uvloop sends each at once: two system calls for every JSON answer, the
second often a separate TCP segment. `HeadHeld` holds a write that starts a response (`HTTP/`)
until the next write, and sends both as one buffer then; a head with no body in the same turn of
the event loop (a stream's) goes at the turn's end. Every other write goes at once, so a stream's
chunks are not delayed. The order of writes is kept, and closing sends a held head first.

    config = uvicorn.Config(app, http=OneSendProtocol, ...)
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD = b"HTTP/"


class HeadHeld(asyncio.Transport):
    """A transport that holds a response's head until its body is written, then sends both together."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._head: bytes | bytearray | memoryview | None = None
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data` (with a held head before it); hold it instead when it starts a response."""
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(b"".join((head, data)))
        elif data[:5] == _HEAD:
            self._head = data
            self._loop.call_soon(self._send)
        else:
            self._transport.write(data)

    def _send(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        """Send a held head, then close."""
        self._send()
        self._transport.close()

    def abort(self) -> None:
        """Close at once, dropping a held head."""
        self._head = None
        self._transport.abort()

    def is_closing(self) -> bool:
        """Whether the connection is closing or closed."""
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The connection's extra information (peer and socket names, SSL object)."""
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        """Stop reading from the socket (flow control)."""
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        """Read from the socket again."""
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        """Whether the socket is being read."""
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand the connection to another protocol (a WebSocket upgrade)."""
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The protocol the connection's reads go to."""
        return self._transport.get_protocol()

    def get_write_buffer_size(self) -> int:
        """Bytes held here and in the transport's own buffer."""
        return (len(self._head) if self._head is not None else 0) + self._transport.get_write_buffer_size()


class OneSendProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through `HeadHeld`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the connection, each response's head sent with its body."""
        super().connection_made(HeadHeld(transport))
