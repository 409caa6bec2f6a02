"""A run on another host is judged by what the monitor scrapes, on the monitor's own clock: never
by probing its pid here, never by the times its files carry (the hosts' clocks may disagree)."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

import pytest

from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.monitor.sources.liveness import REMOTE_DEAD_AFTER_S, dead_run, incarnation_of
from lossguard.monitor.sources.scrape import ScrapeSource
from tests.support.promserver import ExpositionServer

pytestmark = pytest.mark.live

HERE = socket.gethostname()
REMOTE = "gpu-node-9"
SKEW_S = 7 * 24 * 3600.0  # the remote host's clock runs a week ahead


def remote_run(
    run_dir: Path, url: str = "http://gpu-node-9:9410/metrics", **fields: object
) -> AgentInfo:
    """An agent.json naming another host (whose clock is a week ahead: its file times too)
    and the pid of a process alive here (ours): a local probe would call it alive."""
    run_dir.mkdir(parents=True, exist_ok=True)
    info = AgentInfo(run_id="r", metrics_urls=(url,), socket=None)
    changes = {"pid": os.getpid(), "hostname": REMOTE, "started_at": time.time() + SKEW_S, **fields}
    info = dataclasses.replace(info, **changes)  # type: ignore[arg-type]
    (run_dir / "agent.json").write_text(info.to_json())
    ahead = time.time() + SKEW_S
    os.utime(run_dir / "agent.json", (ahead, ahead))
    return info


def test_a_remote_run_is_alive_while_it_answers_and_dead_once_silent(tmp_path: Path) -> None:
    info = remote_run(tmp_path)
    now = 10_000.0
    answered = {incarnation_of(info): now - 5}
    assert dead_run(info, tmp_path, HERE, answered.get, now) is None
    silent = now + REMOTE_DEAD_AFTER_S + 30
    gone = dead_run(info, tmp_path, HERE, answered.get, silent)
    assert gone is not None and (gone.host, gone.exit) == (REMOTE, "crashed")
    assert gone.last_seen == now - 5  # its last answer on the monitor's clock, not a file time


def test_a_remote_run_never_scraped_here_cannot_be_judged(tmp_path: Path) -> None:
    """No answer seen by this monitor (a monitor restarted, an exporter it cannot reach): not
    judged dead; LossguardAgentDown tells of an unreachable one."""
    assert dead_run(remote_run(tmp_path), tmp_path, HERE, lambda _: None, time.time()) is None


def test_a_remote_run_that_recorded_its_failure_is_dead(tmp_path: Path) -> None:
    info = remote_run(tmp_path, exit="failed", finished_at=time.time())
    gone = dead_run(info, tmp_path, HERE, lambda _: None, time.time())
    assert gone is not None and (gone.host, gone.exit) == (REMOTE, "failed")


def test_the_scraper_judges_a_remote_run_by_its_answers_on_its_own_clock(tmp_path: Path) -> None:
    """A remote run's rank 0 answers, then its host goes away: dead REMOTE_DEAD_AFTER_S of
    the scraper's clock later (the run's own clock and file times a week ahead do not count);
    the new process of the run (another pid) is judged afresh."""
    exporter = ExpositionServer('lossguard_step{run_id="r",rank="0"} 5\n')
    try:
        remote_run(tmp_path / "r", url=exporter.url)
        source = ScrapeSource(static_targets=[], runs_root=tmp_path, retention_s=600.0)
        t = 1_000.0
        source.scrape_once(t)
        assert [s.up for s in source.targets()] == [True] and source.dead_runs() == []
        exporter.status = 503
        source.scrape_once(t + REMOTE_DEAD_AFTER_S)
        assert [s.up for s in source.targets()] == [False] and source.dead_runs() == []
        source.scrape_once(t + REMOTE_DEAD_AFTER_S + 1)
        [dead] = source.dead_runs()
        assert (dead.run_id, dead.host, dead.last_seen) == ("r", REMOTE, t)
        # a restart of the run (a new process, answering): scraped again, not dead
        exporter.status = 200
        remote_run(tmp_path / "r", url=exporter.url, pid=os.getpid() + 1)
        source.scrape_once(t + REMOTE_DEAD_AFTER_S + 2)
        assert source.dead_runs() == [] and [s.up for s in source.targets()] == [True]
        source.close()
    finally:
        exporter.close()
