"""lossguard-ctl and ControlClient against a small real socket server that speaks protocol v1."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from lossguard.common.control.client import (
    MAX_REPLY_BYTES,
    ControlClient,
    ControlError,
    ControlTimeout,
    ControlUnavailable,
)
from lossguard.common.control.protocol import (
    ErrorCode,
    ProtocolError,
    Request,
    encode,
    error_reply,
    ok_reply,
    parse_request,
)
from lossguard.common.rundir.names import SOCKET_NAME
from lossguard.ctl.cli import main

pytestmark = pytest.mark.live

TOKEN = "s3cret-token-4f9a1c"
CREATED = 1_700_000_000.0
STATUS: dict[str, Any] = {
    "run_id": "tiny",
    "step": 1840,
    "max_steps": 5000,
    "tokens": 1_884_160,
    "paused": False,
    "stopping": False,
    "lr": 3e-4,
    "lr_scale": 0.5,
    "last_train_loss": 2.34567,
    "last_val_loss": 2.4,
    "world_size": 2,
    "pid": 4242,
    "uptime_seconds": 3723.4,
    "checkpoint": {
        "latest": "step_00001800",
        "best": "step_00001600",
        "last_good": "step_00001600",
        "in_progress": False,
    },
}


def _checkpoint(name: str, step: int, healthy: bool, **fields: Any) -> dict[str, Any]:
    meta = {"name": name, "step": step, "seq": step // 400, "tokens": step * 1024}
    return {**meta, "healthy": healthy, **fields}


CHECKPOINTS: dict[str, Any] = {
    "checkpoints": [
        _checkpoint(
            "step_00001600",
            1600,
            True,
            reason="periodic",
            train_loss=2.41,
            val_loss=2.45,
            created_at=CREATED,
        ),
        _checkpoint(
            "memory/step_00001700",
            1700,
            True,
            reason="snapshot",
            train_loss=2.40,
            val_loss=None,
            created_at=CREATED + 0.2,
            in_memory=True,
        ),
        _checkpoint(
            "step_00001800",
            1800,
            False,
            reason="nan_loss",
            train_loss=None,
            val_loss=None,
            created_at=CREATED + 0.4,
        ),
    ],
    "latest": "step_00001800",
    "best": "step_00001600",
    "last_good": "memory/step_00001700",
}
RESULTS: dict[str, dict[str, Any]] = {
    "status": STATUS,
    "checkpoints": CHECKPOINTS,
    "save": {"name": "step_00001200", "step": 1200, "healthy": True, "seconds": 0.4213},
    "rollback": {
        "from_step": 1840,
        "to_step": 1600,
        "checkpoint": "step_00001600",
        "skipped_batches": 200,
        "lr_scale": 0.5,
    },
    "pause": {"step": 1840, "paused": True},
    "resume": {"step": 1840, "paused": False},
    "set_lr_scale": {"lr_scale": 0.5, "lr": 3e-4},
    "expect_change": {"step": 1840},
    "stop": {"step": 1840, "checkpoint": "step_00001840"},
}
# (command line after the address, protocol command)
COMMAND_LINES = [
    (["status"], "status"),
    (["checkpoints"], "checkpoints"),
    (["save"], "save"),
    (["rollback", "1600", "--skip-batches", "200", "--lr-scale", "0.5"], "rollback"),
    (["pause"], "pause"),
    (["resume"], "resume"),
    (["set-lr-scale", "0.5"], "set_lr_scale"),
    (["expect-change", "--reason", "data mix v2"], "expect_change"),
    (["stop"], "stop"),
]


class Action(Enum):
    HANG = "hang"  # read on, never reply
    CLOSE = "close"  # close the connection without replying


Reply = dict[str, Any] | bytes | Action
Responder = Callable[[Request], Reply]


def scripted(request: Request) -> Reply:
    return ok_reply(request.id, RESULTS[request.cmd])


class FakeAgent:
    """A listening socket served by a thread; each request line is checked by the agent's own
    parser, recorded, and answered by ``respond``: a reply (a dict sent as one line, or raw
    bytes) or an ``Action``."""

    def __init__(self, server: socketserver.BaseServer, address: str) -> None:
        self.server = server
        self.address = address
        self.respond: Responder = scripted
        self.requests: list[Request] = []
        self.connections = 0
        self.hang_up_after: int | None = None  # requests answered per connection, then close

    def handle(self, rfile: Any, wfile: Any) -> None:
        self.connections += 1
        for answered, line in enumerate(rfile):
            if answered == self.hang_up_after:
                return
            try:
                request = parse_request(line.rstrip(b"\n"))
            except ProtocolError as exc:
                wfile.write(encode(error_reply(exc.request_id, exc.code, exc.message)))
                continue
            self.requests.append(request)
            reply = self.respond(request)
            if reply is Action.CLOSE:
                return
            if reply is not Action.HANG:
                wfile.write(reply if isinstance(reply, bytes) else encode(reply))


@pytest.fixture
def serve() -> Iterator[Callable[[socketserver.BaseServer, str], FakeAgent]]:
    servers: list[tuple[socketserver.BaseServer, threading.Thread]] = []

    def start(server: socketserver.BaseServer, address: str) -> FakeAgent:
        agent = FakeAgent(server, address)

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                with contextlib.suppress(OSError):  # the client went away mid-reply
                    agent.handle(self.rfile, self.wfile)

        server.RequestHandlerClass = Handler
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
        thread.start()
        servers.append((server, thread))
        return agent

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join()


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


class _TcpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True


@pytest.fixture
def unix_agent(serve: Callable[..., FakeAgent], tmp_path: Path) -> FakeAgent:
    path = tmp_path / SOCKET_NAME
    return serve(_UnixServer(str(path), socketserver.StreamRequestHandler), str(path))


@pytest.fixture
def tcp_agent(serve: Callable[..., FakeAgent]) -> FakeAgent:
    server = _TcpServer(("127.0.0.1", 0), socketserver.StreamRequestHandler)
    agent = serve(server, f"127.0.0.1:{server.server_address[1]}")

    def check_token(request: Request) -> Reply:
        if request.token != TOKEN:
            return error_reply(request.id, ErrorCode.UNAUTHORIZED, "missing or wrong token")
        return scripted(request)

    agent.respond = check_token
    return agent


def ctl(
    capsys: pytest.CaptureFixture[str], *argv: str, agent: FakeAgent | None = None
) -> tuple[int, str, str]:
    """Run ``lossguard-ctl [--socket AGENT] ARGV`` in-process: (exit code, stdout, stderr)."""
    address = ["--socket", agent.address] if agent is not None else []
    code = main([*address, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("lossguard-ctl: error: ")
    return lines[0]


def test_status_is_aligned_key_value_lines(capsys, unix_agent: FakeAgent) -> None:
    code, out, err = ctl(capsys, "status", agent=unix_agent)
    assert (code, err) == (0, "")
    assert out == (
        "run        tiny\n"
        "step       1840 / 5000\n"
        "tokens     1,884,160\n"
        "state      running\n"
        "lr         3.0e-04\n"
        "lr scale   0.5\n"
        "train loss 2.3457\n"
        "val loss   2.4000\n"
        "world size 2\n"
        "pid        4242\n"
        "uptime     1:02:03\n"
        "latest     step_00001800\n"
        "best       step_00001600\n"
        "last good  step_00001600\n"
        "saving     no\n"
    )


def test_status_before_anything_is_known(capsys, unix_agent: FakeAgent) -> None:
    checkpoint = {"latest": None, "best": None, "last_good": None, "in_progress": True}
    early = {**STATUS, "step": 0, "max_steps": None, "paused": True, "stopping": True, "lr": None}
    early.update(last_train_loss=None, last_val_loss=None, checkpoint=checkpoint)
    unix_agent.respond = lambda request: ok_reply(request.id, early)
    code, out, _ = ctl(capsys, "status", agent=unix_agent)
    assert code == 0
    assert out == (
        "run        tiny\n"
        "step       0\n"
        "tokens     1,884,160\n"
        "state      paused, stopping\n"
        "lr         -\n"
        "lr scale   0.5\n"
        "train loss -\n"
        "val loss   -\n"
        "world size 2\n"
        "pid        4242\n"
        "uptime     1:02:03\n"
        "latest     -\n"
        "best       -\n"
        "last good  -\n"
        "saving     yes\n"
    )


def test_checkpoints_table_marks_latest_best_and_last_good(capsys, unix_agent: FakeAgent) -> None:
    code, out, _ = ctl(capsys, "checkpoints", agent=unix_agent)
    created = datetime.fromtimestamp(CREATED).isoformat(timespec="seconds")
    header, first, in_memory, second = out.splitlines()
    assert code == 0
    assert header.split() == [
        *("name", "step", "healthy", "val", "loss", "train", "loss"),
        *("created", "reason", "marks"),
    ]
    assert first.split() == [
        *("step_00001600", "1600", "yes", "2.4500", "2.4100", created),
        *("periodic", "best"),
    ]
    assert in_memory.split()[:3] == ["memory/step_00001700", "1700", "yes"]
    assert in_memory.endswith("snapshot  last_good")  # the name says where it is
    assert second.split() == [
        "step_00001800",
        "1800",
        "no",
        "-",
        "-",
        created,
        "nan_loss",
        "latest",
    ]
    assert first.index(created) == second.index(created) == header.index("created")
    assert max(len(line) for line in out.splitlines()) <= 100


@pytest.mark.parametrize(
    ("argv", "result", "expected"),
    [
        (
            ["checkpoints"],
            {"checkpoints": [], "latest": None, "best": None, "last_good": None},
            "no checkpoints",
        ),
        (["save"], None, "saved step_00001200 (step 1200, healthy) in 0.42 s"),
        (
            ["save"],
            {"name": "step_00000007", "step": 7, "healthy": False, "seconds": 3},
            "saved step_00000007 (step 7, unhealthy) in 3.00 s",
        ),
        (
            ["rollback", "1600"],
            None,
            "rolled back from step 1840 to step 1600 (step_00001600); skipped 200 batches; "
            "lr scale 0.5",
        ),
        (["pause"], None, "paused at step 1840"),
        (["resume"], None, "resumed at step 1840"),
        (["set-lr-scale", "0.5"], None, "lr scale 0.5 (lr 3.0e-04)"),
        (["set-lr-scale", "2"], {"lr_scale": 2.0, "lr": None}, "lr scale 2"),
        (
            ["expect-change"],
            None,
            "change expected at step 1840: the spike detectors start again from the current level",
        ),
        (["stop"], None, "stopping at step 1840; saved step_00001840"),
        (["stop"], {"step": 3, "checkpoint": None}, "stopping at step 3; no checkpoint saved"),
    ],
)
def test_one_line_results(
    capsys, unix_agent: FakeAgent, argv: list[str], result: dict[str, Any] | None, expected: str
) -> None:
    if result is not None:
        unix_agent.respond = lambda request: ok_reply(request.id, result)
    assert ctl(capsys, *argv, agent=unix_agent) == (0, expected + "\n", "")


@pytest.mark.parametrize(("argv", "cmd"), COMMAND_LINES)
def test_json_prints_the_result_as_sent(
    capsys, unix_agent: FakeAgent, argv: list[str], cmd: str
) -> None:
    code, out, err = ctl(capsys, "--json", *argv, agent=unix_agent)
    assert (code, err) == (0, "")
    assert json.loads(out) == RESULTS[cmd]
    assert out.startswith("{\n  ")  # indent 2
    assert [r.cmd for r in unix_agent.requests] == [cmd]


def test_arguments_and_request_ids_on_the_wire(capsys, unix_agent: FakeAgent) -> None:
    assert ctl(capsys, *COMMAND_LINES[3][0], agent=unix_agent)[0] == 0
    assert ctl(capsys, "rollback", "last_good", agent=unix_agent)[0] == 0
    assert ctl(capsys, "set-lr-scale", "0.25", agent=unix_agent)[0] == 0
    first, second, third = unix_agent.requests
    assert first.args == {"target": 1600, "skip_batches": 200, "lr_scale": 0.5}
    assert second.args == {"target": "last_good", "skip_batches": 0, "lr_scale": 1.0}
    assert (third.cmd, third.args) == ("set_lr_scale", {"scale": 0.25})
    assert all(re.fullmatch(r"ctl-[0-9a-f]{12}", r.id) for r in unix_agent.requests)
    assert len({r.id for r in unix_agent.requests}) == 3
    assert all(r.token is None for r in unix_agent.requests)  # no token over the Unix socket


def test_skip_batches_abandoned_on_the_wire_and_in_words(capsys, unix_agent: FakeAgent) -> None:
    abandoned = {
        "signal": "loss",
        "step": 1805,
        "nonfinite": True,
        "value": None,
        "zscore": None,
        "window_mean": 2.4,
        "causes": ["non-finite values in the forward or backward pass (check the data at 1804)"],
    }
    result = {**RESULTS["rollback"], "skipped_batches": 240, "abandoned": abandoned}
    unix_agent.respond = lambda request: ok_reply(request.id, result)
    argv = ["rollback", "last_good", "--skip-batches", "abandoned", "--lr-scale", "0.5"]
    code, out, err = ctl(capsys, *argv, agent=unix_agent)
    assert (code, err) == (0, "")
    assert unix_agent.requests[0].args == {
        "target": "last_good",
        "skip_batches": "abandoned",
        "lr_scale": 0.5,
    }
    assert out == (
        "rolled back from step 1840 to step 1600 (step_00001600); skipped 240 batches; "
        "lr scale 0.5\n"
        "abandoned: loss non-finite at step 1805: non-finite values in the forward or backward "
        "pass (check the data at 1804)\n"
    )
    spike = {**abandoned, "nonfinite": False, "value": 9.5, "zscore": 14.2, "causes": []}
    unix_agent.respond = lambda request: ok_reply(request.id, {**STATUS, "episode": spike})
    code, out, _ = ctl(capsys, "status", agent=unix_agent)
    assert code == 0 and out.endswith("episode    loss spike at step 1805 (9.5, z 14.2)\n")


def test_expect_change_sends_its_reason_and_refuses_a_bad_one(
    capsys, unix_agent: FakeAgent
) -> None:
    assert ctl(capsys, "expect-change", "--reason", "data mix v2", agent=unix_agent)[0] == 0
    assert ctl(capsys, "expect-change", agent=unix_agent)[0] == 0
    assert [r.args for r in unix_agent.requests] == [{"reason": "data mix v2"}, {"reason": ""}]
    for bad, why in (("two\nlines", "printable text on one line"), ("x" * 201, "at most 200")):
        code, out, err = ctl(capsys, "expect-change", "--reason", bad, agent=unix_agent)
        assert (code, out) == (2, "")
        assert err.splitlines()[-1].startswith("lossguard-ctl: error: expect-change: reason: must")
        assert why in err
    assert len(unix_agent.requests) == 2  # nothing was sent for the bad ones


@pytest.mark.parametrize("skip", ["all", "1.5", "-1", ""])
def test_skip_batches_must_be_a_count_or_abandoned(capsys, skip: str) -> None:
    code, out, err = ctl(capsys, "--socket", "a.sock", "rollback", "best", "--skip-batches", skip)
    assert (code, out) == (2, "")
    assert "skip" in err.splitlines()[-1] and "Traceback" not in err


def test_run_dir_finds_the_socket(capsys, unix_agent: FakeAgent) -> None:
    run_dir = str(Path(unix_agent.address).parent)
    assert ctl(capsys, "--run-dir", run_dir, "pause")[:2] == (0, "paused at step 1840\n")


def test_refused_command_exits_1_with_one_line(capsys, unix_agent: FakeAgent) -> None:
    unix_agent.respond = lambda request: error_reply(
        request.id, ErrorCode.NOT_FOUND, "no healthy checkpoint to roll back to"
    )
    code, out, err = ctl(capsys, "rollback", "last_good", agent=unix_agent)
    assert (code, out) == (1, "")
    assert err == "lossguard-ctl: error: not_found: no healthy checkpoint to roll back to\n"


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (lambda request: ok_reply("someone-else", STATUS), "does not match request id"),
        (lambda request: b"{not json\n", "not valid JSON"),
        (lambda request: b"[1, 2]\n", "boolean 'ok'"),
        (lambda request: ok_reply(request.id, {"step": 5}), "unexpected status result"),
    ],
)
def test_unreadable_reply_is_bad_reply(
    capsys, unix_agent: FakeAgent, reply: Responder, reason: str
) -> None:
    unix_agent.respond = reply
    code, out, err = ctl(capsys, "status", agent=unix_agent)
    assert (code, out) == (1, "")
    assert one_error_line(err).startswith("lossguard-ctl: error: bad_reply: ") and reason in err


def test_no_reply_times_out_with_exit_4(capsys, unix_agent: FakeAgent) -> None:
    unix_agent.respond = lambda request: Action.HANG
    code, out, err = ctl(capsys, "--timeout", "0.2", "save", agent=unix_agent)
    assert (code, out) == (4, "")
    assert unix_agent.address in one_error_line(err) and "0.2 s" in err


def test_connection_closed_without_reply_exits_3(capsys, unix_agent: FakeAgent) -> None:
    unix_agent.respond = lambda request: Action.CLOSE
    code, out, err = ctl(capsys, "stop", agent=unix_agent)
    assert (code, out) == (3, "")
    assert unix_agent.address in one_error_line(err) and "without replying" in err


def test_no_socket_exits_3_naming_it(capsys, tmp_path: Path) -> None:
    code, out, err = ctl(capsys, "--run-dir", str(tmp_path / "gone"), "status")
    assert (code, out) == (3, "")
    assert str(tmp_path / "gone" / SOCKET_NAME) in one_error_line(err)


def test_refused_tcp_exits_3_naming_the_address(capsys, monkeypatch) -> None:
    with socket.socket() as probe:  # a port that nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("LOSSGUARD_CONTROL_TOKEN", TOKEN)
    code, out, err = ctl(capsys, "--tcp", f"127.0.0.1:{port}", "status")
    assert (code, out) == (3, "")
    assert f"127.0.0.1:{port}" in one_error_line(err)
    assert TOKEN not in err


def test_tcp_sends_the_token_from_the_environment(capsys, monkeypatch, tcp_agent) -> None:
    monkeypatch.setenv("LOSSGUARD_CONTROL_TOKEN", TOKEN)
    code, out, err = ctl(capsys, "--tcp", tcp_agent.address, "status")
    assert (code, err) == (0, "") and "step       1840 / 5000" in out
    monkeypatch.setenv("MY_TOKEN", TOKEN)
    monkeypatch.setenv("LOSSGUARD_CONTROL_TOKEN", "wrong-token")
    code, json_out, _ = ctl(
        capsys, "--tcp", tcp_agent.address, "--token-env", "MY_TOKEN", "--json", "pause"
    )
    assert code == 0 and json.loads(json_out) == RESULTS["pause"]
    assert [r.token for r in tcp_agent.requests] == [TOKEN, TOKEN]
    assert TOKEN not in out + err + json_out


def test_tcp_wrong_token_is_refused_without_echoing_it(capsys, monkeypatch, tcp_agent) -> None:
    monkeypatch.setenv("LOSSGUARD_CONTROL_TOKEN", "wrong-token")
    code, out, err = ctl(capsys, "--tcp", tcp_agent.address, "status")
    assert (code, out) == (1, "")
    assert one_error_line(err).startswith("lossguard-ctl: error: unauthorized: ")
    assert "wrong-token" not in err


@pytest.mark.parametrize("token_env", [None, "MY_TOKEN"])
def test_tcp_without_the_token_is_a_usage_error(
    capsys, monkeypatch, tcp_agent: FakeAgent, token_env: str | None
) -> None:
    monkeypatch.delenv("LOSSGUARD_CONTROL_TOKEN", raising=False)
    monkeypatch.delenv("MY_TOKEN", raising=False)
    env_args = [] if token_env is None else ["--token-env", token_env]
    code, out, err = ctl(capsys, "--tcp", tcp_agent.address, *env_args, "status")
    assert (code, out) == (2, "")
    assert (token_env or "LOSSGUARD_CONTROL_TOKEN") in err.splitlines()[-1]
    assert tcp_agent.connections == 0


@pytest.mark.parametrize("target", ["../x", "/tmp/ckpt", "step_1600", "-3", "1.5"])
def test_rollback_to_a_path_is_refused_before_connecting(
    capsys, unix_agent: FakeAgent, target: str
) -> None:
    code, out, err = ctl(capsys, "rollback", target, agent=unix_agent)
    assert (code, out) == (2, "")
    assert "a checkpoint name (step_00000150), never a path" in err.splitlines()[-1]
    assert unix_agent.connections == 0


def test_rollback_takes_a_checkpoint_name_for_its_step(capsys, unix_agent: FakeAgent) -> None:
    assert ctl(capsys, "rollback", "step_00001600", agent=unix_agent)[0] == 0
    assert unix_agent.requests[0].args["target"] == 1600
    code, out, _ = ctl(capsys, "rollback", "--help")
    assert code == 0 and "checkpoint name" in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["status"],
        ["--socket", "a.sock", "--run-dir", "run", "status"],
        ["--socket", "a.sock"],
        ["--socket", "a.sock", "frobnicate"],
        ["--tcp", "localhost", "status"],
        ["--tcp", "localhost:99999", "status"],
        ["--socket", "a.sock", "--timeout", "0", "status"],
        ["--socket", "a.sock", "--timeout", "nan", "status"],
        ["--socket", "a.sock", "rollback"],
        ["--socket", "a.sock", "rollback", "best", "--skip-batches", "-1"],
        ["--socket", "a.sock", "rollback", "best", "--lr-scale", "0"],
        ["--socket", "a.sock", "set-lr-scale", "-1"],
        ["--socket", "a.sock", "set-lr-scale", "inf"],
        ["--socket", "a.sock", "status", "extra"],
    ],
)
def test_usage_errors_exit_2(capsys, argv: list[str]) -> None:
    code, out, err = ctl(capsys, *argv)
    assert (code, out) == (2, "")
    assert re.match(r"lossguard-ctl( rollback)?: error: ", err.splitlines()[-1])
    assert "Traceback" not in err


def test_help_documents_the_exit_codes(capsys) -> None:
    code, out, _ = ctl(capsys, "--help")
    assert code == 0
    epilog = out[out.index("exit status:") :]
    for status in ("0", "1", "2", "3", "4"):
        assert re.search(rf"^  {status} ", epilog, re.MULTILINE), status


def test_client_keeps_one_connection_for_several_requests(unix_agent: FakeAgent) -> None:
    with ControlClient(socket_path=Path(unix_agent.address), timeout=5) as client:
        assert client.request("pause", request_id="r1") == RESULTS["pause"]
        assert client.request("rollback", {"target": "best"}) == RESULTS["rollback"]
    assert unix_agent.connections == 1
    first, second = unix_agent.requests
    assert first.id == "r1" and second.args["target"] == "best"


def test_client_retries_once_when_its_kept_connection_was_closed(unix_agent: FakeAgent) -> None:
    unix_agent.hang_up_after = 1  # like the agent dropping an idle connection
    with ControlClient(socket_path=Path(unix_agent.address), timeout=5) as client:
        assert client.request("pause", request_id="r1") == RESULTS["pause"]
        assert client.request("resume", request_id="r2") == RESULTS["resume"]
    assert [r.id for r in unix_agent.requests] == ["r1", "r2"]
    assert unix_agent.connections == 2
    unix_agent.respond = lambda request: Action.CLOSE  # a fresh connection is not retried
    with pytest.raises(ControlUnavailable, match="without replying"):
        ControlClient(socket_path=Path(unix_agent.address), timeout=5).request("save")
    assert unix_agent.connections == 3


def test_error_without_a_request_id_is_the_agents_error(capsys, unix_agent: FakeAgent) -> None:
    unix_agent.respond = lambda request: error_reply(None, ErrorCode.BUSY, "too many connections")
    code, out, err = ctl(capsys, "status", agent=unix_agent)
    assert (code, out, err) == (1, "", "lossguard-ctl: error: busy: too many connections\n")


def test_client_reconnects_after_a_timeout(unix_agent: FakeAgent) -> None:
    def first_hangs(request: Request) -> Reply:
        return Action.HANG if request.id == "r1" else scripted(request)

    unix_agent.respond = first_hangs
    with ControlClient(socket_path=Path(unix_agent.address), timeout=0.2) as client:
        with pytest.raises(ControlTimeout, match=re.escape(f"{unix_agent.address} within 0.2 s")):
            client.request("save", request_id="r1")
        assert client.request("status", request_id="r2") == STATUS
    assert unix_agent.connections == 2


def test_client_refuses_an_oversized_reply(unix_agent: FakeAgent) -> None:
    unix_agent.respond = lambda request: b"x" * (MAX_REPLY_BYTES + 1)
    client = ControlClient(socket_path=Path(unix_agent.address), timeout=5)
    with client, pytest.raises(ControlError, match="exceeds") as caught:
        client.request("status")
    assert caught.value.code == "bad_reply"


def test_client_errors_name_the_address(tmp_path: Path) -> None:
    missing = tmp_path / SOCKET_NAME
    with pytest.raises(ControlUnavailable, match=re.escape(str(missing))):
        ControlClient(socket_path=missing).request("status")
    with pytest.raises(ValueError, match="exactly one"):
        ControlClient()
    with pytest.raises(ValueError, match="exactly one"):
        ControlClient(socket_path=missing, tcp=("127.0.0.1", 1))


def test_console_script_is_installed(unix_agent: FakeAgent) -> None:
    script = Path(sys.executable).with_name("lossguard-ctl")
    result = subprocess.run(
        [str(script), "--socket", unix_agent.address, "pause"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "paused at step 1840\n", "")


def test_ctl_modules_do_not_import_torch() -> None:
    code = (
        "import sys, lossguard.ctl.cli, lossguard.common.control.client\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
