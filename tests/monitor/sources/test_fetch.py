"""The scrapes' HTTP client against a raw server on 127.0.0.1 that answers each request with
the bytes a test gives: chunked bodies, bodies ended by closing, a keep-alive connection the
server closed meanwhile, credentials from the URL, a stall, a bad answer."""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Iterator

import pytest

from lossguard.monitor.sources.fetch import Connection, ScrapeError, ScrapeLoop
from tests.support.processes import free_port


class RawServer:
    """Accepts connections; reads one request head at a time and answers it with the next of
    ``answers`` (closing the connection after it where the answer says so); with no answer
    left, holds the connection open until closed."""

    def __init__(self, answers: list[tuple[bytes, bool]]) -> None:
        self.answers = answers  # (raw answer, close the connection after it)
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while self.answers:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                self.requests.append(head)
                answer, close = self.answers.pop(0)
                conn.sendall(answer)
                if close:
                    return
            self.closed.wait(30)

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@pytest.fixture
def loop() -> Iterator[ScrapeLoop]:
    scrape_loop = ScrapeLoop(4)
    yield scrape_loop
    scrape_loop.close([])


def fetch(loop: ScrapeLoop, connection: Connection) -> bytes | str:
    """One GET on the loop: the body, or the ScrapeError's message."""
    got: list[bytes | str] = []

    async def job() -> None:
        try:
            got.append(await connection.get())
        except ScrapeError as exc:
            got.append(str(exc))

    loop.run([job])
    return got[0]


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\na 1\n"


def test_keep_alive_chunked_and_close_delimited_bodies(loop: ScrapeLoop) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\na \r\n2\r\n2\n\r\n0\r\n\r\n"
    )
    until_close = b"HTTP/1.0 200 OK\r\n\r\na 3\n"
    server = RawServer([(OK, False), (chunked, False), (until_close, True), (OK, False)])
    connection = Connection(f"http://user:s%40cret@127.0.0.1:{server.port}/m?x=1", 1.0)
    assert [fetch(loop, connection) for _ in range(4)] == [b"a 1\n", b"a 2\n", b"a 3\n", b"a 1\n"]
    assert server.connections == 2  # kept alive, then a new one after the close
    first = server.requests[0].decode()
    assert first.startswith("GET /m?x=1 HTTP/1.1\r\n")
    assert f"Authorization: Basic {base64.b64encode(b'user:s@cret').decode()}" in first
    assert "Accept: text/plain;version=0.0.4" in first
    connection.close()
    server.close()


def test_a_kept_connection_the_server_closed_is_opened_again(loop: ScrapeLoop) -> None:
    server = RawServer([(OK, True), (OK, False)])  # closes after the first answer, unannounced
    connection = Connection(f"http://127.0.0.1:{server.port}/metrics", 1.0)
    assert fetch(loop, connection) == b"a 1\n"
    assert fetch(loop, connection) == b"a 1\n"
    assert server.connections == 2
    connection.close()
    server.close()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
            "HTTP 503 Service Unavailable",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\na 1\n",
            "connection closed before the answer ended",
        ),
        (b"", "connection closed before the answer"),
    ],
)
def test_failures_say_why_in_one_line(loop: ScrapeLoop, answer: bytes, reason: str) -> None:
    server = RawServer([(answer, True)])
    connection = Connection(f"http://127.0.0.1:{server.port}/metrics", 1.0)
    assert fetch(loop, connection) == reason
    server.close()


def test_a_stalled_answer_times_out_and_the_loop_goes_on(loop: ScrapeLoop) -> None:
    server = RawServer([(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\na", False)])
    connection = Connection(f"http://127.0.0.1:{server.port}/metrics", 0.2)
    assert fetch(loop, connection) == "timed out after 0.2 s"
    server.close()
    refused = Connection(f"http://127.0.0.1:{free_port()}/metrics", 0.2)  # nothing listens
    assert fetch(loop, refused) == "connection refused"
