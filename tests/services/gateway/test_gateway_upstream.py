"""The proxy's upstream client against raw sockets: keep-alive reuse, stale connections, bad answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from services.devstack.embedded import free_port
from services.gateway.proxy.upstream import UpstreamClient, UpstreamError, UpstreamTimeout

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"


async def _serve(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]) -> AsyncIterator[str]:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)  # type: ignore[arg-type]
    try:
        yield f"http://127.0.0.1:{port}/v1/x"
    finally:
        server.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
    )
    return head + await reader.readexactly(length)


async def test_keep_alive_chunked_and_stale_connections() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        request = await _read_request(reader)
        writer.write(CHUNKED if b"chunked" in request else OK)
        await writer.drain()
        if b"close-after" in request:
            writer.close()  # closes an idle keep-alive connection without saying so
            return
        request = await _read_request(reader)
        writer.write(OK)
        await writer.drain()
        writer.close()

    async for url in _serve(handler):
        client = UpstreamClient(read_timeout_s=2, connect_timeout_s=2)
        first = await client.request("POST", url, b"{}", {"x": "1"})
        assert first.status == 200 and await first.read() == b"{}"
        second = await client.request("POST", url, b"chunked", {})
        assert [p async for p in second.iter_chunks()] and second.complete
        second.release()
        assert connections == 1  # both requests on one kept-alive connection
        third = await client.request("POST", url, b"close-after", {})
        assert await third.read() == b"{}"
        await asyncio.sleep(0.05)
        fourth = await client.request("POST", url, b"again", {})  # the pooled one is dead: a fresh one is used
        assert await fourth.read() == b"{}"
        assert connections == 3
        await client.close()


async def test_errors_and_timeouts() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await _read_request(reader)
        if b"garbage" in request:
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        elif b"cut" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly a part")
            await writer.drain()
            writer.close()
            return
        else:
            await asyncio.sleep(5)
        await writer.drain()
        writer.close()

    async for url in _serve(handler):
        client = UpstreamClient(read_timeout_s=0.3, connect_timeout_s=1)
        with pytest.raises(UpstreamError):
            await client.request("POST", url, b"garbage", {})
        cut = await client.request("POST", url, b"cut", {})
        with pytest.raises(UpstreamError):
            await cut.read()
        with pytest.raises(UpstreamTimeout):
            await client.request("POST", url, b"slow", {})
        with pytest.raises(UpstreamError):
            await client.request("POST", f"http://127.0.0.1:{free_port()}/v1", b"", {})
        with pytest.raises(UpstreamError):
            await client.request("POST", "ftp://example/v1", b"", {})
        await client.close()
