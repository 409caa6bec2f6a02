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
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import unquote, urlsplit

ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
"""The text format only: prometheus-client would otherwise answer in OpenMetrics."""
HEADER_LIMIT = 64 * 1024


class ScrapeError(Exception):
    """Why one scrape failed, in one line."""


def one_line(text: str, limit: int = 200) -> str:
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
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def get(self) -> bytes:
        """The body of a 200 answer within the timeout; ScrapeError otherwise."""
        started = time.perf_counter()
        try:
            return await asyncio.wait_for(self._get(), self.timeout_s)
        except TimeoutError:
            self.close()
            raise ScrapeError(f"timed out after {self.timeout_s:g} s") from None
        except ScrapeError:
            self.close()
            raise
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self.close()
            if isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
                raise ScrapeError("connection refused") from None
            if isinstance(exc, OSError) and (exc.errno or exc.strerror):
                raise ScrapeError(os_error(exc)) from None
            reason = "connection closed before the answer ended"
            if time.perf_counter() - started >= self.timeout_s:
                reason = f"timed out after {self.timeout_s:g} s"
            raise ScrapeError(reason) from None

    async def _get(self) -> bytes:
        if self._streams is not None:
            try:
                return await self._exchange(*self._streams)
            except _Closed:
                self.close()
        self._streams = await asyncio.open_connection(
            self.host,
            self.port,
            ssl=ssl.create_default_context() if self.tls else None,
            limit=HEADER_LIMIT,
        )
        try:
            return await self._exchange(*self._streams)
        except _Closed:
            raise ScrapeError("connection closed before the answer") from None

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(self.request)
        try:
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
        except (ConnectionResetError, BrokenPipeError):
            raise _Closed() from None
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            raise _Closed() from None
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        code, _, reason = rest.partition(" ")
        headers = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await _chunked(reader)
        elif "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        else:
            body, keep = await reader.read(), False
        if not keep:
            self.close()
        if code != "200":
            raise ScrapeError(f"HTTP {code} {reason}".rstrip())
        return body

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body (trailers skipped)."""
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


class ScrapeLoop:
    """Runs scrape jobs concurrently on its own event loop, at most ``limit`` at once; a job is
    a coroutine function that fetches and stores one target."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.loop = asyncio.new_event_loop()

    def run(self, jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
        """Run ``jobs``, returning when every one has ended (each handles its own errors)."""
        if jobs:
            self.loop.run_until_complete(self._all(jobs))

    async def _all(self, jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
        gate = asyncio.Semaphore(self.limit)

        async def bounded(job: Callable[[], Awaitable[None]]) -> None:
            async with gate:
                await job()

        await asyncio.gather(*(bounded(job) for job in jobs))

    def close(self, connections: Sequence[Connection]) -> None:
        """Close ``connections`` and the loop."""
        for connection in connections:
            connection.close()
        self.loop.run_until_complete(asyncio.sleep(0))  # let the transports close
        self.loop.close()
