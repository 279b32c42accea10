"""A second, lean NATS connection that carries the hot path's publishes and their acks.

Hand-written because it was measured: on the gateway, nats-py's own Python (subject validation,
a pending list and a flusher task per publish; per ack its parser, a `Msg`, a subscription queue
and a task) took 14% of the proxy's CPU per call at 32 calls in flight and 22% at 1 (cProfile under
`bench/bench_proxy.py`; the gateway README gives the figures before and after). Here a publish is
written to the socket at once, so a claim also travels while the record is built, and an ack
completes its future from the protocol callback.

It does only that: publishes with a reply subject (PUB, HPUB) and one subscription for the replies
(MSG, HMSG), answering the server's PINGs. Everything else (reads, subscriptions, the JetStream
API, reconnecting) stays on nats-py's connection, and so does publishing wherever this connection
cannot be made: a TLS server, or one that asks for more than a user and password or a token (the
credentials are those of the URL nats-py connected with).

Subjects and header lines are checked for whitespace and line breaks as nats-py checks them: a
line break in either would let one publish inject protocol commands.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import ParseResult

from nats.errors import BadSubjectError

Deliver = Callable[[str, bytes, bool], None]
"""Called with each reply's subject, its data, and whether it says no responder was there (503)."""

_UNSAFE_SUBJECT = re.compile(r"[\s]")
_CRLF = b"\r\n"
_FLUSH_AT = 1 << 20
"""Bytes held for the end of a turn past which they are written at once."""
_JOIN_BELOW = 16 << 10
"""Payloads smaller than this are joined with their protocol line into one buffer (cheaper than a vector)."""


class WireError(Exception):
    """The lean connection could not be made or was lost (publishing goes through nats-py)."""


class NatsWire(asyncio.Protocol):
    """One NATS connection: publish with a reply subject, receive on one subscription (see the module docstring)."""

    def __init__(self, deliver: Deliver, on_lost: Callable[[NatsWire], None]) -> None:
        self.deliver = deliver
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.connected = False
        """Open for publishing (False once closed, by either side)."""
        self._opened = False
        self._buffer = bytearray()
        self._turn: list[bytes] | None = None
        """What was written in this turn of the event loop after its first write (None: nothing yet)."""
        self._turn_bytes = 0
        self._info: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pong: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @classmethod
    async def open(
        cls,
        url: ParseResult,
        inbox: str,
        deliver: Deliver,
        on_lost: Callable[[NatsWire], None],
        *,
        name: str,
        timeout: float,
    ) -> NatsWire:
        """Connect to `url` with its credentials and subscribe to `inbox` (raises `WireError`); `on_lost`
        is called with the connection once it closes, whoever closed it."""
        if url.scheme not in ("nats", ""):
            raise WireError(f"{url.scheme}:// is left to nats-py")
        loop = asyncio.get_running_loop()
        wire = cls(deliver, on_lost)
        try:
            async with asyncio.timeout(timeout):
                await loop.create_connection(lambda: wire, url.hostname or "127.0.0.1", url.port or 4222)
                info = await wire._info
                if info.get("tls_required"):
                    raise WireError("the server asks for TLS")
                wire._write((b"CONNECT %s\r\nPING\r\n" % _connect_options(url, info, name),))
                await wire._pong
        except (OSError, TimeoutError, ValueError) as exc:
            wire.close()
            raise WireError(f"could not connect: {exc!r}") from None
        except BaseException:
            wire.close()
            raise
        wire._write((b"SUB %s 1\r\n" % inbox.encode(),))
        wire.connected = wire._opened = True
        return wire

    def publish(self, subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        """Write one message (with `headers`, as HPUB); raises `WireError` when the connection is gone."""
        if not self.connected:
            raise WireError("the connection is closed")
        if _UNSAFE_SUBJECT.search(subject):  # the reply subject is the caller's own inbox
            raise BadSubjectError(f"a NATS subject may not hold whitespace: {subject!r}")
        if not headers:
            line = b"PUB %s %s %d\r\n" % (subject.encode(), reply.encode(), len(data))
        else:
            lines = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
            if lines.count("\r") != len(headers) or lines.count("\n") != len(headers):  # one CRLF per header
                raise ValueError("a NATS header may not hold a line break")
            head = b"NATS/1.0\r\n%s\r\n" % lines.encode()
            line = b"HPUB %s %s %d %d\r\n%s" % (
                subject.encode(),
                reply.encode(),
                len(head),
                len(head) + len(data),
                head,
            )
        if len(data) < _JOIN_BELOW:
            self._write((b"%s%s\r\n" % (line, data),))
        else:  # a large payload is handed to the socket as it is, not copied into one buffer
            self._write((line, data, _CRLF))

    def close(self) -> None:
        """Close the connection (`on_lost` follows, and fails the waiting publishes)."""
        self.connected = False
        if self.transport is not None:
            self.transport.close()

    def _write(self, parts: tuple[bytes, ...]) -> None:
        """Write at once when nothing was written in this turn of the event loop (a lone claim travels
        while its record is built), else with the turn's other writes in one send at its end (32 calls
        in flight cost one system call a turn, not one a publish)."""
        if self.transport is None or self.transport.is_closing():
            raise WireError("the connection is closed")
        if self._turn is not None:
            self._turn.extend(parts)
            self._turn_bytes += sum(map(len, parts))
            if self._turn_bytes >= _FLUSH_AT:  # a batch of appends: the server starts on it meanwhile
                self.transport.writelines(self._turn)
                self._turn, self._turn_bytes = [], 0
            return
        self.transport.writelines(parts)
        self._turn, self._turn_bytes = [], 0
        asyncio.get_running_loop().call_soon(self._end_turn)

    def _end_turn(self) -> None:
        turn, self._turn = self._turn, None
        if turn and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(turn)

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.connected = False
        for waiter in (self._info, self._pong):
            if not waiter.done():
                waiter.set_exception(WireError(f"the connection closed: {exc!r}"))
        if self._opened:  # also when this side closed it (the server's -ERR): what waits must fail now
            self._opened = False
            self.on_lost(self)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        try:
            used = self._parse(buffer)
        except ValueError as exc:  # a line this client cannot read: drop the connection
            self._fail(WireError(f"unreadable from the server: {exc}"))
            return
        if used:
            del buffer[:used]

    def _parse(self, buffer: bytearray) -> int:
        """Handle every whole operation in `buffer`; how many bytes they took."""
        at = 0
        while True:
            end = buffer.find(_CRLF, at)
            if end < 0:
                return at
            line = bytes(buffer[at:end])
            if line.startswith((b"MSG ", b"HMSG ")):
                taken = self._message(line, buffer, end + 2)
                if taken < 0:
                    return at
                at = taken
                continue
            at = end + 2
            self._control(line)

    def _message(self, line: bytes, buffer: bytearray, start: int) -> int:
        """Deliver the message whose header line is `line`; where the next operation starts, -1 when incomplete."""
        parts = line.split()
        if parts[0] == b"MSG":  # MSG <subject> <sid> [reply] <size>
            header_size, size = 0, int(parts[-1])
        else:  # HMSG <subject> <sid> [reply] <header size> <total size>
            header_size, size = int(parts[-2]), int(parts[-1])
        end = start + size
        if len(buffer) < end + 2:
            return -1
        no_responders = bool(header_size) and bytes(buffer[start : start + header_size]).startswith(b"NATS/1.0 503")
        self.deliver(parts[1].decode(), bytes(buffer[start + header_size : end]), no_responders)
        return end + 2

    def _control(self, line: bytes) -> None:
        if line == b"PING":
            self._write((b"PONG\r\n",))
        elif line == b"PONG":
            if not self._pong.done():
                self._pong.set_result(None)
        elif line.startswith(b"INFO "):
            if not self._info.done():
                self._info.set_result(json.loads(line[5:]))
        elif line.startswith(b"-ERR"):
            error = WireError(f"the server refused: {line[5:].decode(errors='replace')}")
            if not self._pong.done():  # during the handshake (a wrong password, say): not connected
                self._pong.set_exception(error)
            elif b"Permissions Violation" not in line:  # the server closes the connection after any other
                self._fail(error)

    def _fail(self, error: WireError) -> None:
        if not self._pong.done():
            self._pong.set_exception(error)
        self.close()


def _connect_options(url: ParseResult, info: dict[str, Any], name: str) -> bytes:
    """The CONNECT line's JSON: headers and no-responder replies on, the URL's user and password or token."""
    options: dict[str, Any] = {
        "verbose": False,
        "pedantic": False,
        "lang": "python3",
        "version": "rollwire",
        "protocol": 1,
        "headers": True,
        "no_responders": True,
        "name": name,
    }
    if url.username is not None and url.password is not None:
        options["user"], options["pass"] = url.username, url.password
    elif url.username is not None:
        options["auth_token"] = url.username
    if not info.get("headers", False):
        raise WireError("the server does not support headers")
    return json.dumps(options).encode()
