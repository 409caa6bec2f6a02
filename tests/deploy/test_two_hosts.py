"""A monitor on its own host: the monitor and a real Prometheus here, training runs on two
simulated hosts (network namespaces, tests/support/netns.py) that Prometheus finds through file_sd,
as a Slurm job announces its nodes (deploy/slurm/). The monitor runs the shipped config with
``source: prometheus`` and no runs root: it reads no run directory and has no map of runs. It
learns each run from ``lossguard_agent_info`` and reaches it over TCP with the token."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from lossguard.common.control.client import ControlClient, ControlError
from lossguard.common.exitcodes import EXIT_STOPPED
from lossguard.common.rundir.files import write_atomically
from tests.support.netns import Host, hosts
from tests.support.processes import REPO, free_port, stop_processes, supervisor_argv, wait_for
from tests.support.promserver import prometheus
from tests.support.runs import events, stalled_rules, throttle, tiny_settings, write_config

pytestmark = pytest.mark.live

CONTROL_TOKEN = "two-hosts-control-token-0123456789"
MONITOR_TOKEN = "two-hosts-monitor-token-0123456789"
METRICS_PORT, CONTROL_PORT, SUPERVISOR_PORT = 9410, 9420, 9421  # the same on both hosts
NAN_FROM, NAN_STEPS = 30, 60


@pytest.fixture
def two_hosts() -> Iterator[list[Host]]:
    with hosts(2) as made:
        yield made


class Cluster:
    """The monitor on this host, reading Prometheus at ``prom_url`` (None: scraping the
    targets of the file_sd folder ``sd`` itself); runs started on the simulated hosts."""

    def __init__(
        self, tmp_path: Path, corpus_cache: Path, prom_url: str | None, sd: Path, rules: Path
    ) -> None:
        self.tmp_path = tmp_path
        self.corpus_cache = corpus_cache
        self.sd = sd
        self.processes: list[subprocess.Popen[bytes]] = []
        # the hosts' own disks, which the monitor is never told of; short paths, as a control
        # socket's path must be (tmp_path under xdist is too long)
        self.runs = Path(tempfile.mkdtemp(prefix="lghosts-"))
        shipped = yaml.safe_load((REPO / "configs" / "monitor.yml").read_text())
        port = free_port()
        if prom_url is None:  # the shipped scrape settings, targets from file_sd, no runs root
            del shipped["scrape"]["runs_root"]
            shipped["scrape"]["file_sd_files"] = [str(sd / "*.json")]
        else:
            shipped.pop("scrape")
            shipped.update(source="prometheus", prometheus={"url": prom_url})
        shipped.update(discovery={"forget": "5s"}, state={"path": str(tmp_path / "state.db")})
        shipped["rules"]["files"] = [str(rules)]
        shipped["listen"]["port"] = port
        self.monitor_url = f"http://127.0.0.1:{port}"
        config = write_config(tmp_path / "monitor.yml", shipped)
        log = open(tmp_path / "monitor.log", "ab")  # noqa: SIM115 (closed with the process)
        self.monitor = self._start(
            [sys.executable, "-m", "lossguard.monitor.cli", "run", "--config", str(config)], log
        )
        wait_for(self._monitor_up, 60, "the monitor")

    def _start(self, argv: list[str], log: Any) -> subprocess.Popen[bytes]:
        env = {
            "PATH": "/usr/sbin:/usr/bin:/bin",
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
            "LOSSGUARD_CONTROL_TOKEN": CONTROL_TOKEN,
            "LOSSGUARD_MONITOR_TOKEN": MONITOR_TOKEN,
        }
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self.processes.append(process)
        return process

    def _monitor_up(self) -> bool:
        try:
            return requests.get(f"{self.monitor_url}/healthz", timeout=2).ok
        except requests.RequestException:
            return False

    def start_run(
        self, host: Host, run_id: str, *, supervised: bool = False, **sections: Any
    ) -> subprocess.Popen[bytes]:
        """A training run on ``host`` serving metrics and TCP control on the shared ports,
        announced to Prometheus by a file_sd file, as the sbatch script writes it;
        ``supervised``: under lossguard-supervise, serving its TCP control too. Each step takes
        at least 0.05 s (a later ``slow_step`` in ``faults`` wins): the runs wait on the
        monitor, and need not take a core from the other tests meanwhile."""
        sections["faults"] = [throttle(0.05), *sections.get("faults", [])]
        settings = tiny_settings(
            self.runs / host.namespace,
            self.corpus_cache,
            run={"id": run_id},
            telemetry={"host": "0.0.0.0", "port": METRICS_PORT},
            control={"tcp": f"0.0.0.0:{CONTROL_PORT}", "advertise": self.control(host)},
            train={"max_steps": 10**6, "log_every": 1, "eval_every": 10**6},
            checkpoint={"every": 10},
            **sections,
        )
        config = write_config(self.tmp_path / f"{run_id}.yaml", settings)
        agent = [sys.executable, "-m", "lossguard.agent.cli", "run", str(config), "--no-progress"]
        if supervised:
            control = f"{host.address}:{SUPERVISOR_PORT}"
            options = ["--control-tcp", f"0.0.0.0:{SUPERVISOR_PORT}", "--control-advertise"]
            options += [control, "--kill-after", "1s"]
            agent = supervisor_argv(self.run_dir(host, run_id), *options, command=agent)
        log = open(self.tmp_path / f"{run_id}.log", "ab")  # noqa: SIM115
        process = self._start(host.argv(agent), log)
        targets = [{"targets": [f"{host.address}:{METRICS_PORT}"], "labels": {}}]
        write_atomically(self.sd / f"{run_id}.json", json.dumps(targets).encode())
        return process

    def run_dir(self, host: Host, run_id: str) -> Path:
        return self.runs / host.namespace / run_id

    @staticmethod
    def control(host: Host) -> str:
        return f"{host.address}:{CONTROL_PORT}"

    def announced(self) -> dict[str, Any]:
        """What the monitor's runs API says each run announced."""
        listed = requests.get(f"{self.monitor_url}/api/v1/runs", timeout=10).json()["data"]
        return {run["run_id"]: run["announced"] for run in listed["runs"]}

    def ask(self, run_id: str, cmd: str, token: str = MONITOR_TOKEN) -> requests.Response:
        """The monitor's control route."""
        return requests.post(
            f"{self.monitor_url}/api/v1/runs/{run_id}/control",
            json={"cmd": cmd},
            headers={"Authorization": f"Bearer {token}"},
            timeout=120,
        )

    def close(self) -> None:
        stop_processes(*self.processes)
        shutil.rmtree(self.runs, ignore_errors=True)


SHIPPED_RULES = REPO / "alerts" / "lossguard.rules.yml"


@contextmanager
def running_cluster(tmp_path: Path, corpus_cache: Path, rules: Path) -> Iterator[Cluster]:
    """Prometheus (file_sd on a folder) and the monitor (loading ``rules``) on this host."""
    sd = tmp_path / "file_sd"
    sd.mkdir()
    with prometheus(tmp_path / "prometheus", file_sd=sd) as prom:
        made = Cluster(tmp_path, corpus_cache, prom.url, sd, rules)
        try:
            yield made
        finally:
            made.close()


@pytest.fixture
def cluster(tmp_path: Path, corpus_cache: Path, two_hosts: list[Host]) -> Iterator[Cluster]:
    with running_cluster(tmp_path, corpus_cache, SHIPPED_RULES) as made:
        yield made


def scrape(host: Host) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The agent's exposition on ``host``, by series name (none while it does not answer)."""
    try:
        body = requests.get(f"http://{host.address}:{METRICS_PORT}/metrics", timeout=5).text
    except requests.ConnectionError:
        return {}
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def refusal(address: str, token: str) -> str:
    """The error code the control server at ``address`` answers ``status`` with."""
    host, _, port = address.rpartition(":")
    client = ControlClient(tcp=(host, int(port)), token=token, timeout=10)
    with client, pytest.raises(ControlError) as refused:
        client.request("status")
    return refused.value.code


def test_a_run_on_another_host_is_found_rolled_back_paused_resumed_stopped_and_forgotten(
    cluster: Cluster, two_hosts: list[Host]
) -> None:
    """Two runs started after the monitor, on two hosts, on the same ports. The first has NaN
    losses that keep coming (from step 30, for 60 steps): the monitor rolls it back over TCP,
    and only it. Then pause, resume and stop through the monitor's control route; once the
    run is gone from Prometheus, the monitor forgets it within ``discovery.forget``."""
    h1, h2 = two_hosts
    nans = [
        {"kind": "nonfinite_loss", "step": NAN_FROM, "duration": NAN_STEPS, "once": True},
        {
            "kind": "slow_step",
            "step": NAN_FROM,
            "duration": NAN_STEPS,
            "seconds": 0.2,
            "once": True,
        },
    ]
    sick = cluster.start_run(h1, "sick", faults=nans)
    cluster.start_run(h2, "healthy")
    sick_dir, healthy_dir = cluster.run_dir(h1, "sick"), cluster.run_dir(h2, "healthy")

    # each announces where it runs and how it is reached; nothing secret
    info = wait_for(lambda: scrape(h1).get("lossguard_agent_info"), 120, "the agent's info")
    [(labels, value)] = info
    assert value == 1 and labels["run_id"] == "sick" and labels["rank"] == "0"
    assert labels["control"] == cluster.control(h1) and labels["protocol"] == "1"
    assert labels["supervisor"] == "" and CONTROL_TOKEN not in json.dumps(scrape(h1))

    # the lasting NaN: rolled back over TCP, found through Prometheus alone
    rollback = wait_for(
        lambda: next((e for e in events(sick_dir) if e.get("event") == "rollback"), None),
        240,
        "the monitor's rollback of the run on host 1",
    )
    assert rollback["to_step"] < NAN_FROM <= rollback["from_step"]
    assert not [e for e in events(healthy_dir) if e.get("event") == "rollback"]
    # the monitor's view: both runs, each reached on its own host at the same port
    announced = cluster.announced()
    assert announced["sick"]["control"] == cluster.control(h1)
    assert announced["healthy"]["control"] == cluster.control(h2)
    assert announced["sick"]["host"] == h1.address and announced["healthy"]["supervisor"] is None

    # a wrong token is refused and counted; the right one (the monitor's) still works
    assert refusal(cluster.control(h1), "not-the-token-0123456789") == "unauthorized"
    refusals = {
        labels["reason"]: value for labels, value in scrape(h1)["lossguard_control_refusals_total"]
    }
    assert refusals["unauthorized"] >= 1

    for cmd, paused in (("pause", True), ("resume", False)):
        answer = cluster.ask("sick", cmd)
        assert answer.status_code == 200, answer.text
        [(_, gauge)] = scrape(h1)["lossguard_paused"]
        assert gauge == (1.0 if paused else 0.0)
    status = cluster.ask("healthy", "status")
    assert status.status_code == 200 and status.json()["data"]["result"]["run_id"] == "healthy"

    assert cluster.ask("sick", "stop").status_code == 200
    assert sick.wait(120) == EXIT_STOPPED
    (cluster.sd / "sick.json").unlink()  # the job's exit removes its file_sd file
    gone = cluster.ask("sick", "status")
    wait_for(
        lambda: cluster.ask("sick", "status").status_code == 404,
        60,
        "the monitor to forget the run that ended",
    )
    assert gone.status_code in (404, 503)
    assert cluster.ask("healthy", "status").status_code == 200
    # the monitor's own control route refuses a wrong token too
    assert cluster.ask("sick", "status", token="wrong-token-0123456789").status_code == 403


def test_a_monitor_scraping_file_sd_targets_itself_finds_and_forgets_a_run(
    tmp_path: Path, corpus_cache: Path, two_hosts: list[Host]
) -> None:
    """No Prometheus: the monitor scrapes the targets of the file_sd files a job writes
    (``scrape.file_sd_files``), learns the run from its announcement, controls it over TCP,
    and forgets it once its file is gone. A file that is not file_sd is skipped."""
    h1 = two_hosts[0]
    sd = tmp_path / "file_sd"
    sd.mkdir()
    (sd / "broken.json").write_text('{"targets": "not a list of groups"')
    cluster = Cluster(tmp_path, corpus_cache, None, sd, SHIPPED_RULES)
    try:
        cluster.start_run(h1, "found")
        found = wait_for(lambda: cluster.announced().get("found"), 120, "the announced run")
        assert found["control"] == cluster.control(h1) and found["host"] == h1.address
        for cmd in ("pause", "resume"):
            assert cluster.ask("found", cmd).status_code == 200
        (cluster.sd / "found.json").unlink()
        wait_for(
            lambda: cluster.ask("found", "status").status_code == 404,
            60,
            "the monitor to forget the run whose file is gone",
        )
        log = (tmp_path / "monitor.log").read_text()
        assert log.count("file_sd: skipping") == 1 and "broken.json" in log
    finally:
        cluster.close()


def test_a_hung_supervised_run_on_another_host_is_restarted_over_tcp(
    tmp_path: Path, corpus_cache: Path, two_hosts: list[Host]
) -> None:
    """The training process on host 2 hangs at step 25: TrainingStalled fires and the monitor
    asks the run's supervisor, at the address the run announced, to restart it; it resumes
    from its last checkpoint."""
    h2 = two_hosts[1]
    with running_cluster(tmp_path, corpus_cache, stalled_rules(tmp_path)) as cluster:
        cluster.start_run(h2, "hung", supervised=True, faults=[{"kind": "hang", "step": 25}])
        run_dir = cluster.run_dir(h2, "hung")
        info = wait_for(lambda: scrape(h2).get("lossguard_agent_info"), 120, "the agent's info")
        assert info[0][0]["supervisor"] == f"{h2.address}:{SUPERVISOR_PORT}"
        restart = wait_for(
            lambda: next((e for e in events(run_dir) if e.get("event") == "restart"), None),
            180,
            "the restart the monitor asks for",
        )
        assert restart["reason"] == "requested" and restart["resume_from"] == "step_00000020"
        command = next(e for e in events(run_dir) if e.get("cmd") == "restart")
        assert command["args"] == {"reason": "alert TrainingStalled"}
        wait_for(
            lambda: any(
                e.get("event") == "resumed" and e["time"] > restart["time"] for e in events(run_dir)
            ),
            120,
            "the restarted run to resume",
        )
    with sqlite3.connect(tmp_path / "state.db") as db:
        assert db.execute("SELECT kind, state FROM actions").fetchall() == [("restart", "applied")]
