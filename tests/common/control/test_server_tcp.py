"""The control server's TCP listener against peers without the token, on a real ControlServer
(real sockets and threads; a stand-in for the training loop answers what is queued): the token
line must come within the deadline, failures back off (one judgement per back-off, however many
connections wait), a connection that sent its token line is never pushed out, and a short token
is refused at start."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lossguard.common.control import gate as control_gate
from lossguard.common.control import server as control_server
from lossguard.common.control.client import ControlClient, ControlError
from lossguard.common.control.protocol import ok_reply
from lossguard.common.control.server import ControlServer
from tests.support.processes import run_cli, wait_for
from tests.support.runs import tiny_settings, write_config

pytestmark = pytest.mark.live

TOKEN = "tcp-test-token-0123456789"


class Served:
    """A ControlServer on a free port whose queued commands are answered at once."""

    def __init__(self) -> None:
        self.refused: Counter[str] = Counter()
        self.applied: list[str] = []
        self.server = ControlServer(
            socket_path=None,
            tcp=("127.0.0.1", 0),
            token=TOKEN,
            on_refused=lambda reason: self.refused.update([reason]),
        )
        self.server.start()
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._answer, daemon=True)
        self._loop.start()

    @property
    def address(self) -> tuple[str, int]:
        address = self.server.tcp_address
        assert address is not None
        return address

    def _answer(self) -> None:
        while not self._stop.is_set():
            for pending in self.server.take(timeout=0.05):
                self.applied.append(pending.request.id)
                pending.resolve(ok_reply(pending.request.id, {"step": 1}))

    def close(self) -> None:
        self._stop.set()
        self.server.close()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setattr(control_gate, "FIRST_BACKOFF_S", 0.05)
    monkeypatch.setattr(control_gate, "MAX_BACKOFF_S", 0.4)
    live = Served()
    try:
        yield live
    finally:
        live.close()


def test_no_token_line_within_the_deadline_is_cut_off(
    monkeypatch: pytest.MonkeyPatch, served: Served
) -> None:
    monkeypatch.setattr(control_server, "AUTH_DEADLINE_S", 0.5)
    started = time.monotonic()
    with socket.create_connection(served.address, timeout=10) as drip:
        ended = False
        while not ended and time.monotonic() - started < 5:
            try:
                drip.sendall(b" ")  # a byte at a time, never a line
                ended = drip.recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                pass
            except OSError:
                ended = True
            time.sleep(0.05)  # the pace of the drip, not a wait for the server
    assert ended and time.monotonic() - started < 3
    wait_for(lambda: served.refused["timeout"] == 1, 5, "the timeout counted")
    assert served.applied == []


def test_wrong_tokens_back_off_and_the_right_one_still_gets_in(served: Served) -> None:
    started = time.monotonic()
    for _ in range(5):
        with ControlClient(tcp=served.address, token="x" * 20, timeout=10) as ctl:
            with pytest.raises(ControlError) as refused:
                ctl.request("status")
            assert refused.value.code == "unauthorized"
    # judged after 0 + 0.05 + 0.1 + 0.2 + 0.4 s of back-off
    assert time.monotonic() - started >= 0.75
    assert served.refused == Counter(unauthorized=5) and served.applied == []
    with ControlClient(tcp=served.address, token=TOKEN, timeout=10) as ctl:
        assert ctl.request("status", request_id="mine") == {"step": 1}
        assert ctl.request("status", request_id="again") == {"step": 1}  # stays authenticated
    assert served.applied == ["mine", "again"]


def test_a_short_token_is_refused_at_start(tmp_path: Path, corpus_cache: Path) -> None:
    with pytest.raises(ValueError, match="at least 16 characters"):
        ControlServer(socket_path=None, tcp=("127.0.0.1", 0), token="short")
    settings = tiny_settings(tmp_path / "runs", corpus_cache, control={"tcp": "127.0.0.1:0"})
    config = write_config(tmp_path / "c.yaml", settings)
    done = run_cli("run", str(config), LOSSGUARD_CONTROL_TOKEN="short")
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "control.tcp" in line and "fewer than 16" in line and "short" not in line.split(":")[-1]
    assert not (tmp_path / "runs" / "tiny" / "events.jsonl").exists()


first_lines = st.one_of(
    st.binary(max_size=200).filter(lambda b: b"\n" not in b),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=30),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(["id", "cmd", "args", "token", "x"]), inner, max_size=4
            )
        ),
        max_leaves=12,
    ).map(lambda value: json.dumps(value).encode()),
    st.builds(
        lambda token, cmd: json.dumps({"id": "f", "cmd": cmd, "token": token}).encode(),
        st.text(max_size=40) | st.just(TOKEN[:-1]) | st.just(TOKEN + " "),
        st.sampled_from(["status", "stop", "rollback"]),
    ),
)


def test_fuzzed_first_lines_without_the_token_are_refused(
    monkeypatch: pytest.MonkeyPatch, served: Served
) -> None:
    monkeypatch.setattr(control_gate, "FIRST_BACKOFF_S", 0.0)
    seen = {"lines": 0}

    @settings(
        max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(line=first_lines)
    def exchange(line: bytes) -> None:
        with socket.create_connection(served.address, timeout=10) as conn:
            conn.sendall(line + b"\n")
            reply = conn.makefile("rb").readline()
        assert json.loads(reply)["error"]["code"] == "unauthorized", reply
        seen["lines"] += 1

    exchange()
    assert seen["lines"] >= 200 and served.applied == []
    assert served.refused["unauthorized"] == seen["lines"]


def test_nested_and_malformed_lines_are_bad_requests_after_the_token(served: Served) -> None:
    """An authenticated peer's bad lines each get one ``bad_request``, and nothing is queued."""
    with socket.create_connection(served.address, timeout=10) as conn:
        reader = conn.makefile("rb")
        conn.sendall(json.dumps({"id": "a", "cmd": "status", "token": TOKEN}).encode() + b"\n")
        assert json.loads(reader.readline())["ok"] is True
        lines = {
            b"[" * 50_000: "JSON nested deeper than 32 levels",
            b'{"id": "n", "args": ' + b"[" * 40 + b"]" * 40 + b"}": "nested deeper than 32",
            b"{not json": "not valid JSON",
            b'{"id": "x"}': "cmd: must be a string",
        }
        for line, says in lines.items():
            conn.sendall(line + b"\n")
            reply = json.loads(reader.readline())
            assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply
            assert says in reply["error"]["message"], reply
    assert served.applied == ["a"]


def token_line(token: str, request_id: str = "r") -> bytes:
    return json.dumps({"id": request_id, "cmd": "status", "token": token}).encode() + b"\n"


def flood(address: tuple[str, int], count: int, line: bytes | None) -> list[socket.socket]:
    """``count`` connections from this address, each sending ``line`` (None: nothing)."""
    conns = []
    for _ in range(count):
        conn = socket.create_connection(address, timeout=10)
        if line is not None:
            with contextlib.suppress(OSError):  # refused at once (busy) before it was sent
                conn.sendall(line)
        conns.append(conn)
    return conns


def test_a_client_that_sent_its_token_is_never_pushed_out(served: Served) -> None:
    """The probe's lock-out: connections waiting out the peer's back-off kept their slots and
    new ones cut off the oldest, the right client's included. Now one that sent its token line
    keeps its slot until judged: a flood of silent connections, then of wrong tokens, cannot
    push it out; once every slot holds a sent line, a new connection is told ``busy`` at once."""
    for _ in range(4):  # the peer (this address) is in back-off: the next line waits its turn
        with (
            ControlClient(tcp=served.address, token="x" * 20, timeout=10) as ctl,
            pytest.raises(ControlError),
        ):
            ctl.request("status")
    client = socket.create_connection(served.address, timeout=30)
    client.sendall(token_line(TOKEN, "mine"))
    crowd = flood(served.address, 100, None) + flood(served.address, 100, token_line("y" * 20))
    try:
        reply = json.loads(client.makefile("rb").readline())
        assert reply == {"id": "mine", "ok": True, "result": {"step": 1}}, reply
        assert served.applied == ["mine"]
        wait_for(lambda: served.refused["busy"] > 0, 10, "a busy refusal")
    finally:
        client.close()
        for conn in crowd:
            conn.close()


def test_guessing_is_bounded_however_many_connections_wait(served: Served) -> None:
    """The probe's guessing rate: connections waiting together were all judged when the
    back-off ended (16 at a time; 1,442 in 25 s in a flood). Now a peer's lines are judged one
    per back-off (0.4 s at most here) whatever the number waiting."""
    started = time.monotonic()
    waves = []
    while time.monotonic() - started < 3.0:
        waves += flood(served.address, 20, token_line("z" * 20))
        time.sleep(0.1)  # the flood's pace, not a wait for the server
    elapsed = time.monotonic() - started
    judged = served.refused["unauthorized"]
    for conn in waves:
        conn.close()
    # turns at 0, 0.05, 0.15, 0.35 s (the back-off doubling), then one per 0.4 s
    assert 3 <= judged <= 4 + (elapsed - 0.35) / 0.4 + 1, (judged, elapsed, served.refused)
    assert served.applied == []


def test_one_address_cannot_hold_every_slot_nor_have_cut_off_lines_judged(
    monkeypatch: pytest.MonkeyPatch, served: Served
) -> None:
    """Lines waiting for their turn hold at most 4 of the 16 slots per address, so a flood from
    one address (127.0.0.2 here) leaves room for another's client; and a connection cut off to
    make room is refused, never judged from the part of a line it had sent."""
    monkeypatch.setattr(control_gate, "FIRST_BACKOFF_S", 2.0)  # lines wait while we look
    monkeypatch.setattr(control_gate, "MAX_BACKOFF_S", 2.0)
    other = ("127.0.0.2", 0)
    partial = []
    for _ in range(16):
        conn = socket.create_connection(served.address, timeout=10, source_address=other)
        conn.sendall(b'{"id": "p", "cmd": "status", "token": "half-a-li')  # no end of line
        partial.append(conn)
    held = []
    for _ in range(16):  # each cuts off a partial one, then sends a whole wrong line
        conn = socket.create_connection(served.address, timeout=10, source_address=other)
        conn.sendall(token_line("w" * 20))
        held.append(conn)
    try:
        # those over the 4 waiting lines (and the partial lines cut off for them) are refused
        wait_for(lambda: served.refused["busy"] >= 12, 10, "the lines over the cap refused")
        with ControlClient(tcp=served.address, token=TOKEN, timeout=10) as ctl:
            assert ctl.request("status", request_id="other-address") == {"step": 1}
        assert served.refused["unauthorized"] <= 2  # only lines that had their turn
    finally:
        for conn in partial + held:
            conn.close()
