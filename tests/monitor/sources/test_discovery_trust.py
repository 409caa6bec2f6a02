"""Discovery believes only run files no one else could have written: a planted ``agent.json``
or ``supervisor.json`` (another user's, in a directory others may write, a symbolic link, one
naming another socket or another host's exporter) is skipped with a warning, a duplicate run id
goes to the live process, and a real monitor keeps watching the victim run."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from lossguard.common.rundir.names import SUPERVISOR_FILE
from lossguard.monitor.sources import discovery
from lossguard.monitor.sources.discovery import discover_agents, trust_owners
from tests.support.processes import start_monitor, stop_process, wait_for
from tests.support.runs import write_monitor_config

pytestmark = pytest.mark.live

NOBODY = 65534  # another local user
HOST = socket.gethostname()


def announce(
    root: Path, name: str, run_id: str = "victim", started_at: float = 100.0, **fields: object
) -> Path:
    """A run directory ``name`` with an agent.json as the agent writes it (mode 0700/0644)."""
    run_dir = root / name
    run_dir.mkdir(mode=0o700)
    info = {
        "run_id": run_id,
        "pid": None,
        "hostname": HOST,
        "metrics_urls": ["http://127.0.0.1:9410/metrics"],
        "socket": str(run_dir / "control.sock"),
        "started_at": started_at,
        **fields,
    }
    (run_dir / "agent.json").write_text(json.dumps(info))
    return run_dir


def chown_tree(path: Path, uid: int) -> None:
    for item in (path, *path.iterdir()):
        os.chown(item, uid, -1)


@pytest.fixture(autouse=True)
def own_user_only() -> Iterator[None]:
    trust_owners(())
    yield
    trust_owners(())


def watched(root: Path) -> list[tuple[str, Path]]:
    return [(t.run_id, t.run_dir) for t in discover_agents(root)]


@pytest.mark.parametrize(
    ("plant", "why"),
    [
        (lambda d: chown_tree(d, NOBODY), "is owned by nobody (uid 65534), not a trusted user"),
        (lambda d: os.chown(d / "agent.json", NOBODY, -1), "agent.json is owned by nobody"),
        (lambda d: d.chmod(0o777), "is writable by others (mode 0777)"),
        (lambda d: d.chmod(0o770), "is writable by others (mode 0770)"),
        (lambda d: (d / "agent.json").chmod(0o646), "is writable by others (mode 0646)"),
    ],
)
def test_a_planted_agent_json_does_not_take_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, plant, why: str
) -> None:
    victim = announce(tmp_path, "victim")
    planted = announce(
        tmp_path,
        "planted",
        started_at=200.0,  # newer: it used to win
        metrics_urls=["http://127.0.0.1:6666/metrics"],
    )
    plant(planted)
    with caplog.at_level(logging.WARNING, logger=discovery.__name__):
        assert watched(tmp_path) == [("victim", victim)]
    assert why in caplog.text and "planted" in caplog.text


def test_an_allowed_user_is_believed(tmp_path: Path) -> None:
    team = announce(tmp_path, "team", run_id="teammate")
    chown_tree(team, NOBODY)
    assert watched(tmp_path) == []
    trust_owners([NOBODY])
    assert watched(tmp_path) == [("teammate", team)]


def test_a_symbolic_link_is_not_followed(tmp_path: Path, caplog) -> None:
    elsewhere = announce(tmp_path, "elsewhere")
    linked = tmp_path / "runs" / "linked"
    linked.mkdir(parents=True, mode=0o700)
    (linked / "agent.json").symlink_to(elsewhere / "agent.json")
    with caplog.at_level(logging.WARNING, logger=discovery.__name__):
        assert watched(tmp_path / "runs") == []
    assert "is a symbolic link" in caplog.text


def test_the_socket_is_the_run_directorys_own(tmp_path: Path, caplog) -> None:
    own = announce(tmp_path, "own", socket="/some/where/control.sock")  # another mount point
    assert [t.socket_path for t in discover_agents(tmp_path)] == [own / "control.sock"]
    announce(tmp_path, "other", run_id="other", socket="/tmp/attacker.sock")
    with caplog.at_level(logging.WARNING, logger=discovery.__name__):
        assert [t.run_id for t in discover_agents(tmp_path)] == ["victim"]
    assert "'/tmp/attacker.sock' is not the run directory's control.sock" in caplog.text


def test_rank_0_metrics_are_on_the_announced_host(tmp_path: Path, caplog) -> None:
    announce(tmp_path, "a", run_id="named", metrics_urls=[f"http://{HOST}:9410/metrics"])
    announce(tmp_path, "b", run_id="bound", metrics_urls=["http://10.1.2.3:9410/metrics"])
    announce(tmp_path, "c", run_id="far", metrics_urls=["http://evil.example:9410/metrics"])
    with caplog.at_level(logging.WARNING, logger=discovery.__name__):
        assert sorted(t.run_id for t in discover_agents(tmp_path)) == ["bound", "named"]
    assert "is not on the host the run announces" in caplog.text


def test_a_duplicate_run_id_goes_to_the_live_process(tmp_path: Path, caplog) -> None:
    live = announce(tmp_path, "live", pid=os.getpid(), started_at=100.0)
    announce(tmp_path, "stale", pid=2**22 + 7, started_at=500.0)  # newer, but no such process
    with caplog.at_level(logging.WARNING, logger=discovery.__name__):
        assert watched(tmp_path) == [("victim", live)]
        assert watched(tmp_path) == [("victim", live)]
    (warning,) = [r.getMessage() for r in caplog.records if "announced by 2" in r.getMessage()]
    assert "watching" in warning and str(live) in warning


def test_a_planted_supervisor_json_is_not_believed(tmp_path: Path, caplog) -> None:
    run_dir = announce(tmp_path, "victim")
    supervisor = {
        "run_id": "victim",
        "pid": os.getpid(),
        "hostname": HOST,
        "state": "running",
        "socket": "/tmp/attacker.sock",
        "metrics_url": "http://127.0.0.1:6666/metrics",
    }
    (run_dir / SUPERVISOR_FILE).write_text(json.dumps(supervisor))
    os.chown(run_dir / SUPERVISOR_FILE, NOBODY, -1)
    with caplog.at_level(logging.WARNING, logger=discovery.__name__):
        found = discovery.discover(tmp_path, now=0.0, forget_after_s=1.0)
    assert found.supervisors == []
    assert "supervisor.json is owned by nobody" in caplog.text


def test_a_real_monitor_keeps_the_victim_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    victim = announce(runs, "victim", pid=os.getpid())
    planted = announce(runs, "planted", pid=os.getpid(), started_at=900.0)
    chown_tree(planted, NOBODY)
    rules = tmp_path / "r.yml"
    rules.write_text("groups: []\n")
    config, url = write_monitor_config(
        tmp_path / "monitor.yml", [rules], scrape={"runs_root": str(runs)}
    )
    monitor = start_monitor(config)
    try:
        found = wait_for(
            lambda: _get(f"{url}/api/v1/runs/victim"), 60, "the monitor to serve the run"
        )
        assert found["data"]["run_dir"] == str(victim)
        log = config.with_suffix(".log").read_text()
        assert f"skipping {planted / 'agent.json'}" in log or f"skipping {planted}" in log
    finally:
        assert stop_process(monitor) == 0


def _get(url: str) -> dict | None:
    try:
        reply = requests.get(url, timeout=5)
    except requests.ConnectionError:
        return None
    return reply.json() if reply.status_code == 200 else None
