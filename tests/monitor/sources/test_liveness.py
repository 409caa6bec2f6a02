"""Liveness that names the run: discovery tells a dead process from an unreachable exporter.
Real processes (started, their pid written into ``agent.json``, then killed), real run files,
and the scrape source's series read back through the shipped rules' expressions."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.checkpoints import META_FILE, checkpoint_name, meta_fields
from lossguard.common.rundir.supervisor_file import SupervisorInfo, SupervisorState
from lossguard.monitor.metrics import MonitorMetrics
from lossguard.monitor.notify.facts import RunFacts
from lossguard.monitor.promql import Sample
from lossguard.monitor.sources.discovery import Discovery, SupervisorTarget, discover
from lossguard.monitor.sources.liveness import RUN_EXITED, DeadRun
from lossguard.monitor.sources.scrape import ScrapeSource
from tests.support.processes import REPO
from tests.support.promserver import ExpositionServer, free_port

pytestmark = pytest.mark.live

HOST = socket.gethostname()
DAY = 86400.0
URL = "http://127.0.0.1:9/metrics"  # nothing listens: a dead run is never scraped
RULES = {
    rule["alert"]: rule["expr"]
    for group in yaml.safe_load((REPO / "alerts" / "lossguard.rules.yml").read_text())["groups"]
    for rule in group["rules"]
}


@pytest.fixture
def start_process() -> Iterator[Callable[[], subprocess.Popen]]:
    """Start real processes that sleep until killed (all killed at the end)."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return started[-1]

    yield start
    for process in started:
        kill(process)


def kill(process: subprocess.Popen) -> None:
    """SIGKILL, and reap it: its pid no longer runs."""
    process.kill()
    process.wait()


def write_agent(run_dir: Path, pid: int | None, *urls: str, **changes: Any) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    info = AgentInfo(run_dir.name, urls, None, time.time(), pid, HOST, len(urls), "test")
    info = dataclasses.replace(info, **changes)
    (run_dir / "agent.json").write_text(info.to_json())
    return run_dir


def write_metrics(run_dir: Path, *records: dict) -> None:
    lines = [json.dumps(record) for record in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "st')  # torn


def write_checkpoint(run_dir: Path, step: int, seq: int, healthy: bool) -> None:
    folder = run_dir / "checkpoints" / checkpoint_name(step)
    folder.mkdir(parents=True)
    meta = meta_fields(step, 0, healthy, "" if healthy else "spike", None, None, None)
    meta |= {"seq": seq, "created_at": 0.0, "files": {}, "config_hash": None, "versions": {}}
    (folder / META_FILE).write_text(json.dumps(meta))


def write_supervisor(
    run_dir: Path,
    pid: int,
    state: SupervisorState,
    host: str = HOST,
    metrics_url: str | None = None,
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    info = SupervisorInfo(run_dir.name, pid, host, 1.0, state, metrics_url=metrics_url)
    (run_dir / "supervisor.json").write_text(info.to_json())


def back_date(path: Path, seconds_ago: float) -> float:
    then = time.time() - seconds_ago
    os.utime(path, (then, then))
    return then


def look(runs: Path, forget_after_s: float = DAY) -> Discovery:
    return discover(runs, now=time.time(), forget_after_s=forget_after_s)


# ------------------------------------------------------------------------------ discovery


def test_a_killed_process_turns_its_run_from_targets_into_a_dead_run(
    tmp_path: Path, start_process
) -> None:
    process = start_process()
    run = write_agent(tmp_path / "r1", process.pid, URL, "http://127.0.0.1:10/metrics")
    back_date(run / "agent.json", 100)  # older than the last record
    logged_at = time.time() - 30
    write_metrics(
        run,
        {"kind": "train", "step": 10, "time": logged_at - 10},
        {"kind": "train", "step": 20, "time": logged_at - 5},
        {"kind": "eval", "step": 20, "time": logged_at},
    )
    write_checkpoint(run, 10, seq=1, healthy=True)
    write_checkpoint(run, 20, seq=2, healthy=False)
    found = look(tmp_path)
    assert [(t.run_id, t.rank) for t in found.agents] == [("r1", 0), ("r1", 1)]
    assert found.dead == []

    kill(process)
    found = look(tmp_path)
    assert found.agents == []
    assert found.dead == [
        DeadRun(
            run_id="r1",
            run_dir=run,
            pid=process.pid,
            host=HOST,
            metrics_urls=(URL, "http://127.0.0.1:10/metrics"),
            exit="crashed",
            last_seen=logged_at,
            last_step=20,
            last_checkpoint="step_00000020 (not healthy; last good step_00000010)",
            supervisor="none",
        )
    ]


@pytest.mark.parametrize("exit", ["failed", "completed", "stopped"])
def test_a_recorded_exit_is_named_and_a_clean_one_drops_the_run(
    tmp_path: Path, start_process, exit: str
) -> None:
    process = start_process()
    finished_at = time.time() + 5  # the newest sign of life
    write_agent(tmp_path / "r1", process.pid, URL, exit=exit, finished_at=finished_at)
    kill(process)
    found = look(tmp_path)
    assert found.agents == []
    if exit == "failed":
        (dead,) = found.dead
        assert (dead.exit, dead.last_seen, dead.last_step, dead.last_checkpoint) == (
            "failed",
            finished_at,
            None,
            None,
        )
    else:
        assert found.dead == []


def test_runs_this_host_cannot_check_stay_targets(tmp_path: Path, start_process) -> None:
    process = start_process()
    kill(process)
    write_agent(tmp_path / "elsewhere", process.pid, URL, hostname="gpu-node-7")
    write_agent(tmp_path / "no-pid", None, URL)
    found = look(tmp_path)
    assert sorted(t.run_id for t in found.agents) == ["elsewhere", "no-pid"]
    assert found.dead == []


def test_the_newest_agent_json_of_a_run_decides(tmp_path: Path, start_process) -> None:
    """A resumed run in a second directory: the dead first process is history."""
    old, new = start_process(), start_process()
    write_agent(tmp_path / "first", old.pid, URL, run_id="r1", started_at=100.0)
    write_agent(tmp_path / "second", new.pid, URL, run_id="r1")
    kill(old)
    found = look(tmp_path)
    assert [(t.run_id, t.run_dir.name) for t in found.agents] == [("r1", "second")]
    assert found.dead == []


@pytest.mark.parametrize(
    ("state", "alive", "label"),
    [
        ("running", True, "restarting"),
        ("backoff", True, "restarting"),
        ("crash_loop", True, "crash_loop"),
        ("exited", True, "none"),
        ("backoff", False, "none"),
        (None, False, "none"),
    ],
)
def test_the_supervisor_label_says_what_restarts_the_run(
    tmp_path: Path, start_process, state: SupervisorState | None, alive: bool, label: str
) -> None:
    agent, supervisor = start_process(), start_process()
    run = write_agent(tmp_path / "r1", agent.pid, URL)
    if state is not None:
        write_supervisor(run, supervisor.pid, state)
    kill(agent)
    if not alive:
        kill(supervisor)
    (dead,) = look(tmp_path).dead
    assert dead.supervisor == label


def test_live_supervisors_are_targets(tmp_path: Path, start_process) -> None:
    alive, gone = start_process(), start_process()
    url = "http://127.0.0.1:9500/metrics"
    write_supervisor(tmp_path / "here", alive.pid, "running", metrics_url=url)
    write_supervisor(tmp_path / "gone", gone.pid, "backoff", metrics_url=url)
    write_supervisor(tmp_path / "remote", 1, "crash_loop", "gpu-node-7", url)
    write_supervisor(tmp_path / "remote-exited", 1, "exited", "gpu-node-7", url)
    write_supervisor(tmp_path / "no-exporter", alive.pid, "running")
    kill(gone)
    assert look(tmp_path).supervisors == [
        SupervisorTarget(url, "here", tmp_path / "here"),
        SupervisorTarget(url, "remote", tmp_path / "remote"),
    ]


def test_a_dead_run_is_forgotten_after_the_configured_time(tmp_path: Path, start_process) -> None:
    process = start_process()
    run = write_agent(tmp_path / "r1", process.pid, URL)
    kill(process)
    back_date(run / "agent.json", 3600)  # the last sign of life: an hour ago
    assert [d.run_id for d in look(tmp_path, forget_after_s=2 * 3600).dead] == ["r1"]
    forgotten = look(tmp_path, forget_after_s=1800)
    assert (forgotten.agents, forgotten.dead) == ([], [])


# ------------------------------------------------------------------------------ scraping


@pytest.fixture
def scraping(tmp_path: Path) -> Iterator[ScrapeSource]:
    source = ScrapeSource(static_targets=[], runs_root=tmp_path, retention_s=600)
    yield source
    source.close()


def samples(source: ScrapeSource, expr: str, t: float) -> list[Sample]:
    value = source.query(expr, t)
    assert isinstance(value, list)
    return value


def test_a_dead_run_has_its_series_instead_of_failed_scrapes_until_it_lives_again(
    tmp_path: Path, scraping: ScrapeSource, start_process
) -> None:
    exporter = ExpositionServer('a{run_id="r1",rank="0"} 1\n')  # stands in for the killed agent
    try:
        first = start_process()
        run = write_agent(tmp_path / "r1", first.pid, exporter.url)
        write_metrics(run, {"kind": "train", "step": 40, "time": time.time()})
        write_checkpoint(run, 40, seq=1, healthy=True)
        t = time.time()
        scraping.scrape_once(t)
        assert [s.value for s in samples(scraping, 'up{run_id="r1"}', t)] == [1.0]

        kill(first)
        scraping.scrape_once(t + 1)
        assert samples(scraping, "up", t + 1) == []  # not scraped: no up 0, no "agent down"
        assert samples(scraping, RULES["LossguardAgentDown"], t + 1) == []
        (exited,) = samples(scraping, RUN_EXITED, t + 1)
        assert dict(exited.labels) == {
            "__name__": RUN_EXITED,
            "job": "lossguard-agent",
            "run_id": "r1",
            "host": HOST,
            "exit": "crashed",
            "last_step": "40",
            "last_checkpoint": "step_00000040 (healthy)",
            "supervisor": "none",
        }
        (died,) = samples(scraping, RULES["TrainingProcessDied"], t + 1)
        named = {k: v for k, v in exited.labels if k not in ("__name__", "job")}
        assert dict(died.labels) == named  # whoever exports it: no job or instance
        assert 0 <= died.value < 5  # seconds since its last sign of life
        (status,) = scraping.targets()
        assert (status.run_id, status.rank, status.up) == ("r1", "0", False)
        assert status.last_error == (
            f"process {first.pid} crashed (no exit in agent.json), not scraped: last step 40, "
            "last checkpoint step_00000040 (healthy), supervisor none"
        )
        assert scraping.dead_runs()[0].run_id == "r1"

        second = start_process()  # restarted: a new agent.json with a live pid
        write_agent(run, second.pid, exporter.url)
        scraping.scrape_once(t + 2)
        assert [s.value for s in samples(scraping, 'up{run_id="r1"}', t + 2)] == [1.0]
        assert samples(scraping, RULES["TrainingProcessDied"], t + 2) == []
        assert scraping.dead_runs() == []
    finally:
        exporter.close()


def test_a_run_on_another_host_is_still_agent_down(
    tmp_path: Path, scraping: ScrapeSource, start_process
) -> None:
    process = start_process()
    kill(process)
    write_agent(tmp_path / "r1", process.pid, f"http://127.0.0.1:{free_port()}/metrics")
    remote = f"http://127.0.0.1:{free_port()}/metrics"
    write_agent(tmp_path / "r2", process.pid, remote, hostname="gpu-node-7")
    t = time.time()
    scraping.scrape_once(t)
    down = samples(scraping, RULES["LossguardAgentDown"], t)
    assert [dict(s.labels)["run_id"] for s in down] == ["r2"]
    assert [dict(s.labels)["run_id"] for s in samples(scraping, RUN_EXITED, t)] == ["r1"]


def test_a_forgotten_run_stops_paging(tmp_path: Path, start_process) -> None:
    process = start_process()
    run = write_agent(tmp_path / "r1", process.pid, URL)
    kill(process)
    died = back_date(run / "agent.json", 0)
    source = ScrapeSource(
        static_targets=[], runs_root=tmp_path, retention_s=600, forget_dead_after_s=60
    )
    try:
        source.scrape_once(died + 59)
        assert len(samples(source, RULES["TrainingProcessDied"], died + 59)) == 1
        source.scrape_once(died + 61)
        assert samples(source, RULES["TrainingProcessDied"], died + 61) == []
        assert source.targets() == []
    finally:
        source.close()


def test_a_supervisor_is_scraped_as_its_own_job(tmp_path: Path, scraping: ScrapeSource) -> None:
    exporter = ExpositionServer('lossguard_supervisor_state{run_id="r1",state="running"} 1\n')
    try:
        (tmp_path / "r1").mkdir()
        write_supervisor(tmp_path / "r1", os.getpid(), "running", metrics_url=exporter.url)
        t = time.time()
        scraping.scrape_once(t)
        (state,) = samples(scraping, "lossguard_supervisor_state", t)
        assert dict(state.labels) == {
            "__name__": "lossguard_supervisor_state",
            "job": "lossguard-supervisor",
            "instance": exporter.instance,
            "run_id": "r1",
            "state": "running",
        }
        (target,) = scraping.targets()
        assert (target.job, target.run_id, target.rank, target.up) == (
            "lossguard-supervisor",
            "r1",
            None,
            True,
        )
    finally:
        exporter.close()


# ------------------------------------------------------------------------------ faces


def dead(run_id: str, supervisor: str) -> DeadRun:
    return DeadRun(run_id, Path(run_id), 1, "gpu1", (URL,), "crashed", 1.7e9, 12, None, supervisor)


def test_the_monitor_exports_dead_runs_on_its_metrics() -> None:
    metrics = MonitorMetrics()
    metrics.update_run_exits([dead("r1", "restarting")])
    text = generate_latest(metrics.registry).decode()
    assert (
        'lossguard_run_exited_timestamp_seconds{exit="crashed",host="gpu1",last_checkpoint="",'
        'last_step="12",'
        'run_id="r1",supervisor="restarting"} 1.7e+09'
    ) in text
    metrics.update_run_exits([dead("r1", "none")])  # the supervisor died: one series, relabelled
    text = generate_latest(metrics.registry).decode()
    assert text.count("lossguard_run_exited_timestamp_seconds{") == 1
    assert 'supervisor="none"' in text
    metrics.update_run_exits([])
    assert (
        "lossguard_run_exited_timestamp_seconds{" not in generate_latest(metrics.registry).decode()
    )


def test_a_notification_about_a_dead_run_has_its_last_step(scraping: ScrapeSource) -> None:
    facts = RunFacts(scraping)
    assert facts.of({"run_id": "r1", "last_step": "120"}, time.time()) == (120, ())
    assert facts.of({"run_id": "r1"}, time.time()) == (None, ())
