"""uvicorn's HTTP protocol (httptools) with one socket send per event-loop turn, not one per write.

uvicorn writes a response's status line and headers, then its body, each with its own
`transport.write`, and uvloop sends each at once: two system calls for every JSON answer, the
second often a separate TCP segment. `TurnWrites` holds what a connection writes during one turn
of the event loop and sends it as one buffer at the turn's end (`loop.call_soon`), so a response
whose head and body are sent in the same turn, as every JSON answer is, costs one send. The order
of writes is kept, and closing the connection sends what is held first.

    config = uvicorn.Config(app, http=OneSendProtocol, ...)
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class TurnWrites(asyncio.Transport):
    """A transport that holds the writes of one event-loop turn and sends them together at its end."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._held: list[bytes | bytearray | memoryview] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Hold `data` until the end of this turn (the first write of a turn schedules the send)."""
        if not self._held:
            self._loop.call_soon(self._send)
        self._held.append(data)

    def _send(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        """Send what is held, then close."""
        self._send()
        self._transport.close()

    def abort(self) -> None:
        """Close at once, dropping what is held."""
        self._held = []
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
        return sum(len(data) for data in self._held) + self._transport.get_write_buffer_size()


class OneSendProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through `TurnWrites`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the connection with its writes held until the end of each turn."""
        super().connection_made(TurnWrites(transport))
