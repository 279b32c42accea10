"""`TurnWrites` sends what one event-loop turn wrote as one buffer, in order, and nothing is lost on close.

The unit tests watch a real socket's sends through `SendCounter`, a transport that passes every
write to the real one and counts them (the kernel's own sends cannot be observed from Python). The
last test serves real HTTP through uvicorn with `OneSendProtocol` to a real client.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import uvicorn

from services.common.turnwrites import OneSendProtocol, TurnWrites


class SendCounter(asyncio.Transport):
    """Passes writes and closing to a real transport, keeping what each write carried."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self.real = transport
        self.sends: list[bytes] = []

    def write(self, data: Any) -> None:
        self.sends.append(bytes(data))
        self.real.write(data)

    def close(self) -> None:
        self.real.close()

    def abort(self) -> None:
        self.real.abort()

    def is_closing(self) -> bool:
        return self.real.is_closing()


async def _pair() -> tuple[SendCounter, socket.socket]:
    left, right = socket.socketpair()
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=left)
    right.setblocking(False)
    return SendCounter(transport), right  # type: ignore[arg-type]


async def _read(sock: socket.socket) -> bytes:
    return await asyncio.get_running_loop().sock_recv(sock, 65536)


def test_writes_of_one_turn_go_as_one_send_in_order() -> None:
    async def scenario() -> None:
        counter, peer = await _pair()
        writes = TurnWrites(counter)
        writes.write(b"HTTP/1.1 200 OK\r\n\r\n")
        writes.write(b"body")
        assert counter.sends == []  # held until the turn ends
        await asyncio.sleep(0)
        assert counter.sends == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        writes.write(b"next")
        await asyncio.sleep(0)
        assert counter.sends[1:] == [b"next"]
        assert await _read(peer) == b"HTTP/1.1 200 OK\r\n\r\nbodynext"
        peer.close()
        writes.abort()

    asyncio.run(scenario())


def test_close_sends_what_is_held_and_abort_drops_it() -> None:
    async def scenario() -> None:
        counter, peer = await _pair()
        writes = TurnWrites(counter)
        writes.write(b"last words")
        writes.close()
        assert counter.sends == [b"last words"] and writes.is_closing()
        await asyncio.sleep(0)
        writes.write(b"after close")
        await asyncio.sleep(0)
        assert counter.sends == [b"last words"]
        assert await _read(peer) == b"last words"
        peer.close()

        counter, peer = await _pair()
        writes = TurnWrites(counter)
        writes.write(b"dropped")
        writes.abort()
        await asyncio.sleep(0)
        assert counter.sends == []
        peer.close()

    asyncio.run(scenario())


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"a", b"b", b"c"):
            await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b'{"ok": true}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def test_uvicorn_with_one_send_serves_keep_alive_and_streamed_answers() -> None:
    async def scenario() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(_app, http=OneSendProtocol, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for _ in range(20):  # one kept-alive connection
                    answer = await client.get("/json")
                    assert answer.status_code == 200 and answer.json() == {"ok": True}
                streamed = await client.get("/stream")
                assert streamed.text == "abc"
        finally:
            server.should_exit = True
            await serving

    asyncio.run(scenario())
