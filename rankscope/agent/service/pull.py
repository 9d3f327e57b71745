"""The cluster analyzer's HTTP/1.1 GETs to agents: one connection per agent, kept open from window to window,
and a request's answer read straight into one buffer. An aiohttp client request cost ~0.25 ms of CPU, a third
of a 12,500-agent window's budget; this costs a write, a few reads and one header parse.

Only what an agent's server sends is understood: a status line, headers with Content-Length, the body.
Anything else (chunked bodies, a redirect, a header block over 16 KB, a body over the payload limit) is an
error of that agent alone, as is a connection refused, closed or silent past the timeout.
"""
from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from yarl import URL

MAX_HEAD_BYTES = 16 * 1024


class PullError(Exception):
    """One agent's answer could not be had; the message says why, for its status."""


@dataclass
class Answer:
    status: int
    body: bytes


class _Connection(asyncio.Protocol):
    """One agent's connection: at most one request in flight, its answer parsed as bytes arrive."""

    def __init__(self, max_body: int):
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[Answer] | None = None
        self.status = 0
        self.length: int | None = None  # of the body, once the head is read
        self.keep = True  # the server keeps the connection open after this answer
        self.closed = False
        self.answered = False  # some byte of the current answer has arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(PullError(f"connection closed: {exc}" if exc else "connection closed by the agent"))

    def send(self, request: bytes) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.buffer.clear()
        self.length = None
        self.answered = False
        self.transport.write(request)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.close()  # bytes nobody asked for: the stream cannot be trusted any more
            return
        self.buffer += data
        self.answered = True
        try:
            if self.length is None and not self._head():
                return
        except PullError as e:
            self._fail(e)
            return
        assert self.length is not None
        if len(self.buffer) >= self.length:
            body = bytes(self.buffer[:self.length])
            if len(self.buffer) > self.length or not self.keep:
                self.close()
            self.waiter.set_result(Answer(self.status, body))

    def _head(self) -> bool:
        """Reads the status line and headers once they are all in; False while they are not."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise PullError(f"answer's headers longer than {MAX_HEAD_BYTES} bytes")
            return False
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        del self.buffer[:end + 4]
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise PullError(f"not an HTTP/1 answer: {lines[0][:80]!r}")
        self.status = int(rest[:3])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if "transfer-encoding" in headers or not headers.get("content-length", "").isdigit():
            raise PullError("answer without a Content-Length")
        self.length = int(headers["content-length"])
        if self.length > self.max_body:
            raise PullError(f"answer larger than {self.max_body} bytes")
        self.keep = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        return True

    def _fail(self, error: PullError) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Puller:
    """GETs to many agents, at most `concurrency` at once, each within `timeout_s` (connecting included)."""

    def __init__(self, headers: dict[str, str], timeout_s: float, concurrency: int, max_body: int,
                 ssl_context: ssl.SSLContext | None = None):
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.timeout_s = timeout_s
        self.limit = asyncio.Semaphore(concurrency)
        self.max_body = max_body
        self.ssl_context = ssl_context
        self._open: dict[tuple[str, str, int], _Connection] = {}

    async def get(self, url: str, path: str, query: dict[str, str]) -> Answer:
        target = URL(url).with_path(path).with_query(query)
        if target.scheme not in ("http", "https") or not target.host:
            raise PullError(f"not an http(s) URL: {url}")
        request = (f"GET {target.raw_path_qs} HTTP/1.1\r\nHost: {target.raw_authority}\r\n{self.headers}\r\n"
                   ).encode("latin-1")
        async with self.limit:
            try:
                return await asyncio.wait_for(self._ask(target, request), self.timeout_s)
            except asyncio.TimeoutError:
                self._drop(target)
                raise PullError(f"no answer within {self.timeout_s:g} s") from None
            except OSError as e:
                self._drop(target)
                raise PullError(f"cannot connect: {e.strerror or e}") from None

    async def _ask(self, target: URL, request: bytes) -> Answer:
        key = (target.scheme, target.host or "", target.port or 0)
        conn = self._open.get(key)
        if conn is not None and not conn.closed:
            try:
                return await conn.send(request)
            except PullError:
                if conn.answered:  # a kept connection the agent closed before answering (it restarted,
                    raise          # or its idle timeout) is asked again on a new one; a bad answer is not
        conn = self._open[key] = await self._connect(target)
        return await conn.send(request)

    async def _connect(self, target: URL) -> _Connection:
        if target.scheme == "https" and self.ssl_context is None:
            self.ssl_context = ssl.create_default_context()  # the system's CAs, loaded once, not per agent
        tls = self.ssl_context if target.scheme == "https" else None
        _, conn = await asyncio.get_running_loop().create_connection(
            lambda: _Connection(self.max_body), target.host, target.port, ssl=tls,
            server_hostname=target.host if tls else None)
        return conn

    def _drop(self, target: URL) -> None:
        conn = self._open.pop((target.scheme, target.host or "", target.port or 0), None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for conn in self._open.values():
            conn.close()
        self._open.clear()
