"""A run on another host is judged by its heartbeat, never by probing its pid here; the
agent's rank 0 beats while it lives (lossguard.common.rundir.heartbeat)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import torch
from torch import nn

from lossguard.agent import Guard
from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.heartbeat import (
    REMOTE_DEAD_AFTER_S,
    heartbeat_path,
    heartbeat_text,
    last_beat,
)
from lossguard.monitor.sources.liveness import dead_run
from tests.test_guard import guard_config

HERE = socket.gethostname()
REMOTE = "gpu-node-9"


def remote_run(run_dir: Path, beat_age_s: float | None, **fields: object) -> AgentInfo:
    """An agent.json naming another host and the pid of a process alive here (ours): a local
    probe would call it alive."""
    run_dir.mkdir(parents=True, exist_ok=True)
    info = AgentInfo(run_id="r", metrics_urls=("http://gpu-node-9:9410/metrics",), socket=None)
    info = dataclasses.replace(info, pid=os.getpid(), hostname=REMOTE, **fields)  # type: ignore[arg-type]
    started = time.time() - 3600  # written when the run started, an hour ago
    (run_dir / "agent.json").write_text(info.to_json())
    os.utime(run_dir / "agent.json", (started, started))
    if beat_age_s is not None:
        path = heartbeat_path(run_dir, REMOTE, os.getpid())
        path.parent.mkdir(exist_ok=True)
        path.write_text(heartbeat_text(REMOTE, os.getpid(), time.time() - beat_age_s))
    return info


def test_a_remote_run_is_alive_while_it_beats_and_dead_when_silent(tmp_path: Path) -> None:
    assert dead_run(remote_run(tmp_path / "a", 5.0), tmp_path / "a", HERE) is None
    silent = dead_run(remote_run(tmp_path / "b", REMOTE_DEAD_AFTER_S + 30), tmp_path / "b", HERE)
    assert silent is not None
    assert (silent.host, silent.exit) == (REMOTE, "crashed")
    assert time.time() - silent.last_seen >= REMOTE_DEAD_AFTER_S  # its last beat, not now


def test_a_remote_run_without_a_heartbeat_cannot_be_judged(tmp_path: Path) -> None:
    """An agent from before heartbeats: this host cannot tell (and probes nothing)."""
    assert dead_run(remote_run(tmp_path, None), tmp_path, HERE) is None


def test_a_remote_run_that_recorded_its_failure_is_dead(tmp_path: Path) -> None:
    info = remote_run(tmp_path, 1.0, exit="failed", finished_at=time.time())
    gone = dead_run(info, tmp_path, HERE)
    assert gone is not None and (gone.host, gone.exit) == (REMOTE, "failed")


def test_rank_0_beats_while_it_lives(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    with Guard(tmp_path, model=model, config=guard_config(), progress=False):
        path = heartbeat_path(tmp_path, HERE, os.getpid())
        beat = last_beat(tmp_path, HERE, os.getpid())
        assert beat is not None and abs(time.time() - beat) < 5
        assert json.loads(path.read_text())["pid"] == os.getpid()
        loss = model(torch.ones(2, 4)).sum()
        assert torch.isfinite(loss)
    assert not path.exists()  # agent.json now says how it ended
