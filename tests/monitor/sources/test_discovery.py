"""Discovery of agents through the ``agent.json`` files in the runs directory."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest

from lossguard.common.rundir.directory import RunDirectory
from lossguard.monitor.sources.discovery import (
    DiscoveredTarget,
    discover_agents,
    instance_of,
    redact_url,
)


def start_run(root: Path, run_id: str, *urls: str, started_at: float | None = None) -> Path:
    """Write ``agent.json`` as the agent does; optionally back-date its start."""
    run = RunDirectory(root / run_id)
    run.write_discovery(
        run_id=run_id,
        socket_path=run.path / "control.sock",
        metrics_urls=list(urls),
        world_size=len(urls),
    )
    if started_at is not None:
        update(run.path, started_at=started_at)
    return run.path


HOSTNAME = socket.gethostname()


def update(run_dir: Path, **fields: object) -> None:
    path = run_dir / "agent.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_runs_appear_and_disappear(tmp_path: Path) -> None:
    assert discover_agents(tmp_path) == []
    old = start_run(tmp_path, "old", "http://127.0.0.1:9410/metrics", started_at=100.0)
    assert discover_agents(tmp_path) == [
        DiscoveredTarget(
            "http://127.0.0.1:9410/metrics",
            "old",
            0,
            old / "control.sock",
            old,
            HOSTNAME,
            os.getpid(),
        )
    ]
    new = start_run(
        tmp_path, "new", "http://127.0.0.1:9411/metrics", "http://127.0.0.1:9412/metrics"
    )
    found = discover_agents(tmp_path)
    assert [(t.run_id, t.rank, t.url) for t in found] == [
        ("new", 0, "http://127.0.0.1:9411/metrics"),
        ("new", 1, "http://127.0.0.1:9412/metrics"),
        ("old", 0, "http://127.0.0.1:9410/metrics"),
    ]
    assert found[0].run_dir == new and found[0].socket_path == new / "control.sock"
    (old / "agent.json").unlink()
    assert [t.run_id for t in discover_agents(tmp_path)] == ["new", "new"]


def test_two_runs_naming_one_url_are_two_targets(tmp_path: Path) -> None:
    """A killed run's agent.json stays when a new run takes its port."""
    url = "http://127.0.0.1:9410/metrics"
    start_run(tmp_path, "killed", url, started_at=100.0)
    start_run(tmp_path, "new", url)
    assert [(t.run_id, t.rank, t.url) for t in discover_agents(tmp_path)] == [
        ("new", 0, url),
        ("killed", 0, url),
    ]


@pytest.mark.parametrize(
    ("ending", "kept"),
    [
        ({}, True),
        ({"exit": "failed"}, True),
        ({"exit": "completed"}, False),
        ({"exit": "stopped"}, False),
    ],
)
def test_runs_that_ended_cleanly_are_dropped(tmp_path: Path, ending: dict, kept: bool) -> None:
    run = start_run(tmp_path, "r1", "http://127.0.0.1:9410/metrics")
    if ending:
        update(run, finished_at=1234.5, **ending)
    assert [t.run_id for t in discover_agents(tmp_path)] == (["r1"] if kept else [])


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"run_id": "x", "metrics_ur', "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"run_id": "x"}', "metrics_urls: expected a list, got null"),
        ('{"run_id": 3, "metrics_urls": []}', "run_id: expected a str, got 3"),
        ('{"run_id": "x", "metrics_urls": ["localhost:9410"]}', "'localhost:9410' is not an"),
    ],
)
def test_a_bad_agent_json_is_skipped_and_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, reason: str
) -> None:
    start_run(tmp_path, "good", "http://127.0.0.1:9410/metrics")
    bad = tmp_path / "bad" / "agent.json"
    bad.parent.mkdir()
    bad.write_text(content)
    with caplog.at_level(logging.WARNING, logger="lossguard.monitor.sources.discovery"):
        for _ in range(3):
            assert [t.run_id for t in discover_agents(tmp_path)] == ["good"]
        (record,) = caplog.records
        assert str(bad) in record.getMessage() and reason in record.getMessage()
        assert "\n" not in record.getMessage()
        bad.write_text(content + " ")  # changed, still broken: reported again
        discover_agents(tmp_path)
        assert len(caplog.records) == 2


@pytest.mark.parametrize(
    ("url", "instance", "shown"),
    [
        ("http://127.0.0.1:9410/metrics", "127.0.0.1:9410", "http://127.0.0.1:9410/metrics"),
        ("https://trainer-3/metrics", "trainer-3:443", "https://trainer-3/metrics"),
        ("http://[::1]/metrics", "[::1]:80", "http://[::1]/metrics"),
        ("http://ops:hunter2@node:9410/m", "node:9410", "http://ops:***@node:9410/m"),
    ],
)
def test_instance_label_and_redacted_url(url: str, instance: str, shown: str) -> None:
    assert (instance_of(url), redact_url(url)) == (instance, shown)
