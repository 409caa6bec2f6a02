"""The control socket of a live training process under bad, hostile and concurrent input."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lossguard.common.control.client import ControlClient, ControlError
from lossguard.common.control.protocol import MAX_LINE_BYTES
from lossguard.common.control.server import answered_before
from lossguard.common.exitcodes import EXIT_STOPPED
from lossguard.common.rundir.directory import RunDirectory
from tests.support.processes import ctl_cli, start_agent, wait_for
from tests.support.runs import events, sliced_settings, write_config

pytestmark = pytest.mark.live

TOKEN = "s3cret-token-for-tests"


class Agent:
    """A long-running training process with a Unix socket and a token-protected TCP port."""

    def __init__(self, tmp_path: Path, cache: Path) -> None:
        settings = sliced_settings(
            tmp_path / "runs",
            cache,
            train={"max_steps": 1_000_000, "log_every": 1, "eval_every": 1_000_000},
            control={"tcp": "127.0.0.1:0"},
        )
        self.config = write_config(tmp_path / "c.yaml", settings)
        self.run_dir = tmp_path / "runs/tiny"
        self.socket_path = self.run_dir / "control.sock"
        self.process = start_agent(self.config, env={"LOSSGUARD_CONTROL_TOKEN": TOKEN})
        start = wait_for(self._start_event, 120, "the agent to start")
        host, port = start["control_tcp"]
        self.tcp = (host, port)
        wait_for(lambda: self.step() >= 2, 60, "training to step")

    def _start_event(self) -> dict[str, Any] | None:
        return next((e for e in events(self.run_dir) if e["event"] == "start"), None)

    def step(self) -> int:
        with ControlClient(socket_path=self.socket_path, timeout=30) as ctl:
            return int(ctl.request("status")["step"])

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(str(self.socket_path))
        return sock

    def stop(self) -> None:
        if self.process.poll() is None:
            with ControlClient(socket_path=self.socket_path, timeout=60) as ctl:
                ctl.request("stop")
        self.process.communicate(timeout=60)
        assert self.process.returncode == EXIT_STOPPED


@pytest.fixture
def agent(tmp_path: Path, corpus_cache: Path) -> Iterator[Agent]:
    live = Agent(tmp_path, corpus_cache)
    try:
        yield live
    finally:
        if live.process.poll() is None:
            live.process.kill()
            live.process.communicate()


def read_reply(sock: socket.socket) -> dict[str, Any]:
    """One reply line; replies to pipelined requests may share a read, so buffer per socket."""
    reader = _readers.setdefault(sock.fileno(), sock.makefile("rb"))
    line = reader.readline()
    assert line.endswith(b"\n"), "connection closed without a reply"
    return json.loads(line)


_readers: dict[int, Any] = {}


# Lines a fuzzer sends: garbage, near-misses and valid commands that do not change training.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
harmless = st.sampled_from(["status", "checkpoints"])
# Commands that change training (stop, rollback, ...) only ever with a wrong name or bad args.
near_miss = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=10) | st.integers(0, 10**6),
        "cmd": st.sampled_from(["status", "checkpoints", "stat", "STOP", "rollback ", "", "save!"]),
    },
    optional={"args": json_values, "token": json_values, "extra": json_values},
)
bad_lr = st.builds(
    lambda i, v: {"id": i, "cmd": "set_lr_scale", "args": {"scale": v}},
    st.text(min_size=1, max_size=8),
    st.sampled_from([0, -1, "0.5", None, True, [1], {"x": 1}, 1e400]),
)
path_rollback = st.builds(
    lambda i, p: {"id": i, "cmd": "rollback", "args": {"target": p}},
    st.text(min_size=1, max_size=8),
    st.sampled_from(["../checkpoints/step_1", "/etc/passwd", "./latest", "step_00000010", "1e3"]),
)
lines = st.one_of(
    st.binary(max_size=200).filter(lambda b: b"\n" not in b and b.strip()),
    json_values.map(lambda v: json.dumps(v).encode()),
    near_miss.map(lambda m: json.dumps(m).encode()),
    path_rollback.map(lambda m: json.dumps(m).encode()),
    bad_lr.map(lambda m: json.dumps(m).encode()),
    harmless.map(lambda c: json.dumps({"cmd": c, "id": "h"}).encode()),
)


def test_fuzzed_lines_each_get_one_reply_and_training_goes_on(agent: Agent) -> None:
    before = agent.step()
    sock = agent.connect()
    seen = {"lines": 0}

    @settings(
        max_examples=1500,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=st.lists(lines, min_size=1, max_size=4))
    def exchange(batch: list[bytes]) -> None:
        sock.sendall(b"".join(line + b"\n" for line in batch))  # pipelined
        for _ in batch:
            reply = read_reply(sock)
            assert set(reply) in ({"id", "ok", "result"}, {"id", "ok", "error"}), reply
            if not reply["ok"]:
                assert reply["error"]["code"] in {
                    "bad_request",
                    "unknown_command",
                    "unauthorized",
                    "not_found",
                    "failed",
                }
            seen["lines"] += 1

    exchange()
    _readers.pop(sock.fileno()).close()
    sock.close()
    assert seen["lines"] >= 1500
    after = wait_for(lambda: (s := agent.step()) > before and s, 60, "training to keep stepping")
    assert after > before
    assert agent.process.poll() is None
    changed = [e for e in events(agent.run_dir) if e["event"] in ("rollback", "checkpoint")]
    assert changed == []  # no path, nor anything else the fuzzer sent, touched training state
    with ControlClient(socket_path=agent.socket_path, timeout=30) as ctl:
        assert ctl.request("status")["lr_scale"] == 1.0
    agent.stop()


def test_socket_is_owner_only_and_tcp_needs_the_token(agent: Agent) -> None:
    assert stat.S_IMODE(os.stat(agent.socket_path).st_mode) == 0o600
    trail = [e for e in events(agent.run_dir) if e["event"] == "command"]
    with ControlClient(tcp=agent.tcp, token=None, timeout=30) as ctl:
        with pytest.raises(ControlError) as refused:
            ctl.request("status")
        assert refused.value.code == "unauthorized"
    with (
        ControlClient(tcp=agent.tcp, token="wrong", timeout=30) as ctl,
        pytest.raises(ControlError),
    ):
        ctl.request("status")
    # more connections than there are slots, none of which ever sends a token
    idle = [socket.create_connection(agent.tcp, timeout=30) for _ in range(40)]
    try:
        with ControlClient(tcp=agent.tcp, token=TOKEN, timeout=30) as ctl:
            assert ctl.request("status")["step"] >= 2  # after the back-off of two failures
    finally:
        for conn in idle:
            conn.close()
    refusals = wait_for(
        lambda: (counts := refusal_counts(agent)) and counts["timeout"] >= 40 and counts,
        30,
        "the idle connections cut off and counted",
    )
    assert refusals["unauthorized"] == 2 and refusals["busy"] == 0
    log = (agent.run_dir / "events.jsonl").read_text()
    assert TOKEN not in log and "wrong" not in log
    commands = [e for e in events(agent.run_dir) if e["event"] == "command"]
    new = [(e.get("cmd"), e["ok"]) for e in commands[len(trail) :]]
    assert new == [("status", True)], "refusals are counted, not audited"
    agent.stop()


def refusal_counts(agent: Agent) -> dict[str, float]:
    """``lossguard_control_refusals_total`` by reason, from the agent's exporter."""
    (url,) = json.loads((agent.run_dir / "agent.json").read_text())["metrics_urls"]
    text = requests.get(url, timeout=10).text
    found = re.findall(r'lossguard_control_refusals_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)', text)
    return {reason: float(value) for reason, value in found}


def test_repeated_id_is_answered_from_the_first_result(agent: Agent) -> None:
    with ControlClient(socket_path=agent.socket_path, timeout=30) as ctl:
        first = ctl.request("set_lr_scale", {"scale": 0.5}, request_id="once")
        again = ctl.request("set_lr_scale", {"scale": 0.25}, request_id="once")
        assert again == first and first["lr_scale"] == 0.5
        assert ctl.request("status")["lr_scale"] == 0.5
    applied = [e for e in events(agent.run_dir) if e.get("id") == "once"]
    assert len(applied) == 1
    agent.stop()


def test_oversized_half_closed_slow_and_many_clients(agent: Agent) -> None:
    big = agent.connect()
    big.sendall(
        b'{"id": "big", "cmd": "status", "args": {"x": "' + b"a" * MAX_LINE_BYTES + b'"}}\n'
    )
    assert read_reply(big)["error"]["code"] == "too_large"
    assert big.recv(10) == b""  # then the connection is closed
    big.close()

    half = agent.connect()
    half.sendall(b'{"id": "half", "cmd": "status"}')  # no newline: the write side closes
    half.shutdown(socket.SHUT_WR)
    assert read_reply(half)["ok"] is True
    half.close()

    slow = agent.connect()
    slow.sendall(b'{"id": "slow", "cmd": "sta')  # and then nothing
    replies: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one_client(n: int) -> None:
        sock = agent.connect()
        sock.sendall(json.dumps({"id": f"c{n}", "cmd": "status"}).encode() + b"\n")
        reply = read_reply(sock)
        sock.close()
        with lock:
            replies.append(reply)

    threads = [threading.Thread(target=one_client, args=(n,)) for n in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(replies) == 24
    assert all(r["ok"] or r["error"]["code"] == "busy" for r in replies)
    assert sum(r["ok"] for r in replies) >= 20
    slow.close()
    assert agent.step() > 2
    agent.stop()


def test_lossguard_ctl_drives_a_live_run(agent: Agent) -> None:
    run_dir = str(agent.run_dir)
    status = ctl_cli("--run-dir", run_dir, "status")
    assert status.returncode == 0 and "tiny" in status.stdout
    saved = ctl_cli("--run-dir", run_dir, "save")
    assert saved.returncode == 0 and saved.stdout.startswith("saved step_")
    listing = ctl_cli("--run-dir", run_dir, "--json", "checkpoints")
    listed = json.loads(listing.stdout)["checkpoints"]
    names = [c["name"] for c in listed if not c["in_memory"]]  # beside snapshots in memory
    assert len(names) == 1 and names[0] in saved.stdout
    assert any(c["in_memory"] for c in listed)  # snapshots are listed too
    back = ctl_cli("--run-dir", run_dir, "--json", "rollback", names[0], "--skip-batches", "2")
    assert back.returncode == 0, back.stderr
    result = json.loads(back.stdout)
    # the checkpoint's state: from disk, or from a snapshot of the same step where one is in
    # memory (the cheaper restore of the same state, docs/design.md "Checkpoints and snapshots")
    assert result["checkpoint"] in (names[0], f"memory/{names[0]}")
    assert result["skipped_batches"] == 2
    refused = ctl_cli("--run-dir", run_dir, "rollback", "../../etc")
    assert refused.returncode == 2 and "never a path" in refused.stderr
    missing = ctl_cli("--run-dir", run_dir, "rollback", "999999")
    assert missing.returncode == 1 and "not_found" in missing.stderr
    assert ctl_cli("--run-dir", run_dir, "pause").returncode == 0
    assert json.loads(ctl_cli("--run-dir", run_dir, "--json", "status").stdout)["paused"] is True
    assert ctl_cli("--run-dir", run_dir, "resume").returncode == 0
    stopped = ctl_cli("--run-dir", run_dir, "stop")
    assert stopped.returncode == 0 and "stopping at step" in stopped.stdout
    agent.process.communicate(timeout=60)
    assert agent.process.returncode == EXIT_STOPPED
    gone = ctl_cli("--run-dir", run_dir, "status")
    assert gone.returncode == 3


def test_a_reply_with_a_diverged_loss_is_still_json() -> None:
    from lossguard.common.control.protocol import encode, ok_reply

    line = encode(ok_reply("r", {"last_train_loss": float("nan"), "x": [float("inf"), 1.5]}))
    assert json.loads(line) == {
        "id": "r",
        "ok": True,
        "result": {"last_train_loss": None, "x": [None, 1.5]},
    }


def test_listen_failures_name_their_endpoint(tmp_path: Path) -> None:
    from lossguard.common.control.server import ControlServer, ListenError

    with pytest.raises(ListenError, match="longer than 107 bytes") as too_long:
        ControlServer(socket_path=tmp_path / ("x" * 120) / "control.sock")
    assert too_long.value.endpoint == "socket"
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}") as busy:
            ControlServer(socket_path=tmp_path / "c.sock", tcp=("127.0.0.1", port), token="t" * 16)
        assert busy.value.endpoint == "tcp"
        assert not (tmp_path / "c.sock").exists()  # the socket it did bind is cleaned up
    finally:
        taken.close()


def test_applied_commands_are_read_back_from_the_audit_trail(tmp_path: Path) -> None:
    """What a restarted agent remembers: applied commands with their replies; not requests
    refused before they were queued, nor a line torn by a crash."""
    lines = [
        {"event": "start", "step": 0},
        {
            "event": "command",
            "id": "a",
            "cmd": "pause",
            "args": {},
            "ok": True,
            "result": {"step": 3, "paused": True},
        },
        {
            "event": "command",
            "id": "b",
            "ok": False,
            "error": {"code": "unauthorized", "message": "a valid token is required over TCP"},
        },
        {
            "event": "command",
            "id": "c",
            "cmd": "rollback",
            "args": {"target": 9},
            "ok": False,
            "error": {"code": "not_found", "message": "no checkpoint at step 9"},
        },
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"event": "command", "id": "d'
    (tmp_path / "events.jsonl").write_text(text)
    answered = answered_before(RunDirectory(tmp_path).read_events())
    replies = {p.request.id: p.wait(threading.Event()) for p in answered}
    assert replies == {
        "a": {"id": "a", "ok": True, "result": {"step": 3, "paused": True}},
        "c": {"id": "c", "ok": False, "error": lines[3]["error"]},
    }
