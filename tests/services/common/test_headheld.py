"""`HeadHeld` sends a response's head with its body in one send, sends everything else at once, in order,
and loses nothing on close.

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

from services.common.headheld import HeadHeld, OneSendProtocol


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


def test_a_head_goes_with_its_body_and_other_writes_go_at_once() -> None:
    async def scenario() -> None:
        counter, peer = await _pair()
        writes = HeadHeld(counter)
        writes.write(b"HTTP/1.1 200 OK\r\n\r\n")
        assert counter.sends == []  # held for its body
        writes.write(b"body")
        assert counter.sends == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        writes.write(b"chunk")  # not a head: at once
        assert counter.sends[1:] == [b"chunk"]
        writes.write(b"HTTP/1.1 200 OK\r\n\r\n")  # a stream's head, no body this turn: at the turn's end
        await asyncio.sleep(0)
        assert counter.sends[2:] == [b"HTTP/1.1 200 OK\r\n\r\n"]
        writes.write(b"data: 1")
        assert counter.sends[3:] == [b"data: 1"]
        assert await _read(peer) == b"HTTP/1.1 200 OK\r\n\r\nbodychunkHTTP/1.1 200 OK\r\n\r\ndata: 1"
        peer.close()
        writes.abort()

    asyncio.run(scenario())


def test_close_sends_a_held_head_and_abort_drops_it() -> None:
    async def scenario() -> None:
        counter, peer = await _pair()
        writes = HeadHeld(counter)
        writes.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        writes.close()
        assert counter.sends == [b"HTTP/1.1 204 No Content\r\n\r\n"] and writes.is_closing()
        await asyncio.sleep(0)
        assert len(counter.sends) == 1
        assert await _read(peer) == b"HTTP/1.1 204 No Content\r\n\r\n"
        peer.close()

        counter, peer = await _pair()
        writes = HeadHeld(counter)
        writes.write(b"HTTP/1.1 200 OK\r\n\r\n")
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
