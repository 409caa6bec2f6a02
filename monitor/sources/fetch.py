"""The scrapes' HTTP client: one keep-alive connection per target, GETs run concurrently on one
asyncio loop (no thread per scrape), at most ``limit`` at once, each within its own timeout.

HTTP/1.1 with the parts a ``/metrics`` endpoint uses: ``Content-Length``, chunked bodies,
bodies ended by the connection closing, basic-auth credentials in the URL, https. A request
on a reused connection the server has closed meanwhile is sent again once on a new one.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import resource
import ssl
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import unquote, urlsplit

ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
"""The text format only: prometheus-client would otherwise answer in OpenMetrics."""
HEADER_LIMIT = 64 * 1024


class ScrapeError(Exception):
    """Why one scrape failed, in one line."""


def printable_line(text: str, limit: int = 200) -> str:
    """``text`` on one line of printable characters, cut at ``limit``."""
    flat = " ".join(text.split())
    flat = "".join(c if c.isprintable() else "?" for c in flat)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def os_error(exc: OSError) -> str:
    """An OS error's reason, short and lower-case: "connection refused"."""
    reason = os.strerror(exc.errno) if exc.errno else (exc.strerror or str(exc))
    return reason[:1].lower() + reason[1:]


class _Closed(Exception):
    """The server closed a reused connection before answering: send again on a new one."""


class _Answer:
    """One HTTP answer being read: its head once complete, then its body."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.body_at = -1  # where the body starts, once the head is complete
        self.code = self.reason = ""
        self.length: int | None = None  # Content-Length
        self.chunked = False
        self.keep_alive = True

    def complete(self, eof: bool) -> bytes | None:
        """The body once the answer is complete (None before); ValueError if malformed."""
        if self.body_at < 0:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > HEADER_LIMIT:
                    raise ValueError("the answer's head is too long")
                return None
            self._head(bytes(self.buffer[:end]).decode("latin-1"))
            self.body_at = end + 4
        body = self.buffer[self.body_at :]
        if self.chunked:
            return _dechunk(bytes(body)) if body.endswith(b"0\r\n\r\n") or eof else None
        if self.length is not None:
            return bytes(body[: self.length]) if len(body) >= self.length else None
        return bytes(body) if eof else None

    def _head(self, head: str) -> None:
        status_line, *lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        self.code, _, self.reason = rest.partition(" ")
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        self.keep_alive = version == "HTTP/1.1" and headers.get("connection", "") != "close"
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self.chunked and "content-length" in headers:
            self.length = int(headers["content-length"])
        elif not self.chunked:
            self.keep_alive = False  # the body ends with the connection


def _dechunk(data: bytes) -> bytes:
    """A complete chunked body's content (ValueError if it is not one)."""
    parts: list[bytes] = []
    at = 0
    while True:
        end = data.index(b"\r\n", at)
        size = int(data[at:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(parts)
        parts.append(data[end + 2 : end + 2 + size])
        at = end + 4 + size


class _Protocol(asyncio.Protocol):
    """A connection's reading side: completes the pending answer's future."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.answer: _Answer | None = None
        self.waiter: asyncio.Future[bytes] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.answer is not None:
            self.answer.buffer += data
            self._check(eof=False)

    def eof_received(self) -> bool | None:
        self._end(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc)

    def _end(self, exc: Exception | None) -> None:
        self.lost = True
        if self.answer is None or self.waiter is None or self._check(eof=True):
            return
        if not self.answer.buffer and (exc is None or isinstance(exc, ConnectionResetError)):
            # closed, or reset as our request met a close already under way
            self.waiter.set_exception(_Closed())
        elif isinstance(exc, OSError):
            self.waiter.set_exception(exc)
        else:
            self.waiter.set_exception(ScrapeError("connection closed before the answer ended"))

    def _check(self, eof: bool) -> bool:
        """Complete the waiter if the answer is complete; whether it is done."""
        assert self.answer is not None and self.waiter is not None
        if self.waiter.done():
            return True
        try:
            body = self.answer.complete(eof)
        except ValueError as exc:
            self.waiter.set_exception(ScrapeError(f"bad HTTP answer: {printable_line(str(exc))}"))
            return True
        if body is not None:
            self.waiter.set_result(body)
        return body is not None


class Connection:
    """One target's connection: ``GET url`` with the scrape headers, reconnecting as needed."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = parts.scheme == "https"
        self.timeout_s = timeout_s
        headers = {
            "Host": parts.netloc.rpartition("@")[2],
            "Accept": ACCEPT,
            "User-Agent": "lossguard-monitor",
            "X-Prometheus-Scrape-Timeout-Seconds": f"{timeout_s:g}",
        }
        if parts.username is not None:
            secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(secret.encode()).decode()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"GET {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
        self.request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self._protocol: _Protocol | None = None

    async def get(self) -> bytes:
        """The body of a 200 answer within the timeout; ScrapeError otherwise."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = loop.call_later(self.timeout_s, expire)
        try:
            return await self._get(loop)
        except asyncio.CancelledError:
            self.close()
            if not expired:  # cancelled from outside: not this scrape's business
                raise
            task.uncancel()
            raise ScrapeError(f"timed out after {self.timeout_s:g} s") from None
        except ScrapeError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            if exc.errno == errno.ECONNREFUSED:
                raise ScrapeError("connection refused") from None
            raise ScrapeError(os_error(exc)) from None
        finally:
            timer.cancel()

    async def _get(self, loop: asyncio.AbstractEventLoop) -> bytes:
        if self._protocol is not None and not self._protocol.lost:
            try:
                return await self._exchange(loop, self._protocol)
            except _Closed:
                self.close()
        _, protocol = await loop.create_connection(
            _Protocol,
            self.host,
            self.port,
            ssl=ssl.create_default_context() if self.tls else None,
        )
        self._protocol = protocol
        try:
            return await self._exchange(loop, protocol)
        except _Closed:
            raise ScrapeError("connection closed before the answer") from None

    async def _exchange(self, loop: asyncio.AbstractEventLoop, protocol: _Protocol) -> bytes:
        assert protocol.transport is not None
        answer = protocol.answer = _Answer()
        protocol.waiter = loop.create_future()
        protocol.transport.write(self.request)
        body = await protocol.waiter
        if not answer.keep_alive:
            self.close()
        if answer.code != "200":
            raise ScrapeError(f"HTTP {answer.code} {answer.reason}".rstrip())
        return body

    def close(self) -> None:
        if self._protocol is not None:
            if self._protocol.transport is not None:
                self._protocol.transport.close()
            self._protocol = None


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files to the hard limit, as Go programs such as
    Prometheus do: each target keeps a connection open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class ScrapeLoop:
    """Runs scrape jobs concurrently on its own event loop, at most ``limit`` at once; a job is
    a coroutine function that fetches and stores one target."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.loop = asyncio.new_event_loop()
        raise_open_files_limit()

    def run(self, jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
        """Run ``jobs``, returning when every one has ended (each handles its own errors)."""
        if jobs:
            self.loop.run_until_complete(self._all(jobs))

    async def _all(self, jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
        queue = iter(jobs)

        async def worker() -> None:
            for job in queue:
                await job()

        await asyncio.gather(*(worker() for _ in range(min(self.limit, len(jobs)))))

    def close(self, connections: Sequence[Connection]) -> None:
        """Close ``connections`` and the loop."""
        for connection in connections:
            connection.close()
        self.loop.run_until_complete(asyncio.sleep(0))  # let the transports close
        self.loop.close()
