"""The load generator's bare HTTP client against a scripted server: chunked lines reassembled,
connections kept alive, a connection the server closed while idle never losing a request, the
other ways a body may end, and a server that never answers."""

from __future__ import annotations

import asyncio

import pytest
from mmpipe.app.bench.http_client import BareHttpClient

LINES = ['data: {"n": 1}', "", 'data: {"n": 2, "text": "two words"}', "", "data: [DONE]", ""]
MODES = {
    "keep": "kept alive: every answer on one connection",
    "drop_second": "a second request on a connection is read and the connection closed unanswered (a server "
                   "whose idle timeout fired as the request came)",
    "trailers": "chunked, with a trailer after the last chunk",
    "close": "no length and not chunked: the body ends with the connection",
    "silent": "reads the request and never answers",
}


async def _serve(mode: str) -> tuple[asyncio.AbstractServer, dict[str, int]]:
    """Answers each request with LINES as an SSE stream, cut into chunks across line boundaries
    (see MODES)."""
    seen = {"connections": 0, "answered": 0, "dropped": 0}
    payload = "\n".join(LINES).encode()
    pieces = [payload[:7], payload[7:23], payload[23:]]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
                assert await reader.readexactly(length) == b'{"x": 1}'
                if mode == "silent":
                    await asyncio.sleep(30)
                if mode == "drop_second" and served:
                    seen["dropped"] += 1
                    break
                if mode == "close":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + payload)
                    await writer.drain()
                    seen["answered"] += 1
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for piece in pieces:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                writer.write(b"0\r\nX-Trailer: 1\r\n\r\n" if mode == "trailers" else b"0\r\n\r\n")
                await writer.drain()
                served += 1
                seen["answered"] += 1
        except (asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


@pytest.mark.parametrize("mode, connections, dropped", [("keep", 1, 0), ("drop_second", 3, 2), ("trailers", 1, 0),
                                                        ("close", 3, 0)])
def test_lines_arrive_whole_and_no_request_is_lost(mode, connections, dropped):
    async def run() -> tuple[list[list[str]], dict[str, int]]:
        server, seen = await _serve(mode)
        port = server.sockets[0].getsockname()[1]
        client = BareHttpClient(f"http://127.0.0.1:{port}/v1", "key")
        request = client.encode("chat/completions", b'{"x": 1}')
        assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and b"Authorization: Bearer key" in request
        answers = []
        for _ in range(3):
            async with client.stream(request) as response:
                assert response.status_code == 200
                answers.append([line async for line in response.aiter_lines()])
        await client.aclose()
        server.close()
        await server.wait_closed()
        return answers, seen

    answers, seen = asyncio.run(run())
    assert answers == [LINES[:-1]] * 3  # the last newline ends a line, it starts none
    assert seen["answered"] == 3  # every request answered once
    assert (seen["connections"], seen["dropped"]) == (connections, dropped)


def test_a_server_that_never_answers_times_out():
    async def run() -> float:
        server, _ = await _serve("silent")
        client = BareHttpClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "key", timeout_s=0.3)
        start = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            async with client.stream(client.encode("chat/completions", b'{"x": 1}')):
                pass
        waited = asyncio.get_running_loop().time() - start
        await client.aclose()
        server.close()
        return waited

    assert 0.3 <= asyncio.run(run()) < 5
