"""The load generator's bare HTTP/1.1 client (`mmpipe bench serve --client raw`).

A TTFT that the benchmark sets against the Python API's should hold what the server adds, not
what a client library spends: an HTTP library builds a request object, runs its connection pool
and parses every response in Python, and at one request at a time that is a large part of the
gap being measured. Here each request is the bytes it goes out as (request line, headers, body),
encoded before the run, written on a kept-alive connection (one per request in flight, reused),
and the streamed response is read as its chunks arrive and cut into lines, nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class StaleConnection(ConnectionError):
    """The connection ended before any byte of the response: the server never took the request."""


class BareResponse:
    """One response: its status, then its body's lines (`aiter_lines`, as httpx names it)."""

    def __init__(self, reader: asyncio.StreamReader, status_code: int, headers: dict[str, str]) -> None:
        self.reader, self.status_code, self.headers = reader, status_code, headers
        self.complete = False  # the whole body was read: the connection can carry the next request

    async def aiter_lines(self) -> AsyncIterator[str]:
        pending = b""
        async for data in self._body():
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.rstrip(b"\r").decode()

    async def _body(self) -> AsyncIterator[bytes]:
        codings = self.headers.get("transfer-encoding", "")
        if codings and codings.split(",")[-1].strip().lower() == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while await self.reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                        pass
                    break
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in self.headers:
            yield await self.reader.readexactly(int(self.headers["content-length"]))
        else:  # the body ends with the connection, which then carries nothing more
            yield await self.reader.read()
            return
        self.complete = True


class BareHttpClient:
    """POSTs to one server, each request encoded once (`encode`) and sent by `stream`, which
    gives up (TimeoutError) on a response not read whole within `timeout_s`."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float = 3600.0) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or url.hostname is None:
            raise ValueError(f"{base_url!r}: the bare client speaks plain http:// only")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self.api_key, self.timeout_s = api_key, timeout_s
        self._idle: list[_Connection] = []

    def encode(self, path: str, body: bytes) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        head = (f"POST {self.prefix}/{path} HTTP/1.1\r\nHost: {host}:{self.port}\r\n"
                f"Authorization: Bearer {self.api_key}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n")
        return head.encode() + body

    @contextlib.asynccontextmanager
    async def stream(self, request: bytes) -> AsyncIterator[BareResponse]:
        # One timer a request (not one per read): it cancels the request's task, and the
        # cancellation it caused leaves as a TimeoutError.
        task, expired = asyncio.current_task(), []
        assert task is not None
        timer = asyncio.get_running_loop().call_later(self.timeout_s, lambda: (expired.append(True), task.cancel()))
        response, headers = None, {}
        try:
            reader, writer, headers = await self._send(request)
            try:
                response = BareResponse(reader, int(headers.pop(":status")), headers)
                yield response
            finally:
                if response is not None and response.complete and headers.get("connection", "").lower() != "close":
                    self._idle.append((reader, writer))
                else:
                    writer.close()
        except asyncio.CancelledError:
            if expired:
                raise TimeoutError(f"no whole response in {self.timeout_s:g} s") from None
            raise
        finally:
            timer.cancel()

    async def _send(self, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, str]]:
        """Write `request` and read the response's head. A kept-alive connection the server has
        closed meanwhile (its idle timeout) is dropped, and the request goes on a new one: no
        byte of a response came back on it, so the server never took the request."""
        while self._idle:
            reader, writer = self._idle.pop()
            if reader.at_eof():
                writer.close()
                continue
            try:
                return reader, writer, await self._exchange(reader, writer, request)
            except StaleConnection:
                writer.close()
            except BaseException:
                writer.close()
                raise
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            return reader, writer, await self._exchange(reader, writer, request)
        except BaseException:
            writer.close()
            raise

    @staticmethod
    async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> dict[str, str]:
        try:
            writer.write(request)
            status = (await reader.readuntil(b"\r\n")).split(b" ", 2)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            raise StaleConnection("the server closed the connection") from None
        except ConnectionResetError as exc:
            raise StaleConnection(str(exc)) from None
        headers = {":status": status[1].decode()}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return headers

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
        for _, writer in idle:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
