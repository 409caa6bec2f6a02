"""The monitor against live agents with injected faults, side by side with a real Prometheus
server evaluating the very same rules file on the very same agents.

One scenario, so its slow parts overlap: NaNs that keep coming make LossNonFinite fire and, once
the run is rolled back before them (asked for over the control socket, once the rest has been
seen), resolve (the monitor's actions are off: here it only watches, as Prometheus does, and
pages ActionFailed for the alert nobody acts on); a SIGKILLed agent is known dead
(TrainingProcessDied, from the series the monitor exports on its /metrics, which Prometheus
scrapes too), and
LossguardAgentDown fires for it in neither; the monitor itself is SIGKILLed and restarted
mid-alert and carries on with the same alert (same fingerprint, announced once). Prometheus
must fire and resolve the same alerts, with the same labels, within a few scrape intervals of
the monitor.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from lossguard.common.control.client import ControlClient
from lossguard.common.rundir.names import SOCKET_NAME
from tests.support.processes import (
    REPO,
    free_port,
    start_agent,
    start_monitor,
    stop_processes,
    wait_for,
)
from tests.support.promserver import prometheus
from tests.support.runs import (
    alert_events,
    throttle,
    tiny_settings,
    write_config,
    write_monitor_config,
)

pytestmark = pytest.mark.live

RULES = REPO / "alerts" / "lossguard.rules.yml"
AGREEMENT_S = 6.0  # a few 1 s scrape and evaluation intervals
Key = tuple[tuple[str, str], ...]


class PrometheusAlerts:
    """Polls Prometheus's /api/v1/alerts; when each alert (by labels) was first pending, first
    fired and when it stopped firing."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pending: dict[Key, float] = {}
        self.fired: dict[Key, float] = {}
        self.ended: dict[Key, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            try:
                alerts = requests.get(f"{self.url}/api/v1/alerts", timeout=5).json()
            except (requests.RequestException, ValueError):
                continue
            now = time.time()
            states = {
                tuple(sorted(a["labels"].items())): a["state"] for a in alerts["data"]["alerts"]
            }
            firing = {key for key, state in states.items() if state == "firing"}
            for key in states:
                self.pending.setdefault(key, now)
            for key in firing:
                self.fired.setdefault(key, now)
            for key in set(self.fired) - firing:
                self.ended.setdefault(key, now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def monitor_times(db: Path, kind: str, alertname: str) -> dict[Key, float]:
    return {
        tuple(sorted(e["labels"].items())): e["at"]
        for e in alert_events(db)
        if e["kind"] == kind and e["labels"]["alertname"] == alertname
    }


def firing_gauge(base_url: str, alertname: str) -> bool:
    try:
        text = requests.get(f"{base_url}/metrics", timeout=5).text
    except requests.ConnectionError:
        return False
    return f'lossguard_monitor_alerts{{alertname="{alertname}",state="firing"}} 1.0' in text


def last_good_step(port: int) -> float:
    """The agent's newest healthy state to roll back to, in memory or on disk."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "lossguard_checkpoint_step" and sample.labels.get("kind") == "last_good"
    )


def test_faults_fire_and_resolve_in_the_monitor_as_in_prometheus(
    tmp_path: Path, corpus_cache: Path
) -> None:
    runs = tmp_path / "runs"
    slow = throttle(0.03)
    faults = {
        "nan": [{"kind": "nonfinite_loss", "step": 60, "duration": 10**6, "once": True}, slow],
        "victim": [slow],
    }
    ports = {run_id: free_port() for run_id in faults}
    urls = {run_id: f"http://127.0.0.1:{port}/metrics" for run_id, port in ports.items()}
    config, monitor_url = write_monitor_config(
        tmp_path / "monitor.yml",
        [RULES],
        scrape={"runs_root": str(runs)},
        actions={"enabled": False},
    )
    db = tmp_path / "state.db"
    monitor = start_monitor(config)
    agents: dict[str, subprocess.Popen] = {}
    # Prometheus labels each agent with its run and rank, as the monitor's discovery does
    ranks = {url: {"run_id": run_id, "rank": "0"} for run_id, url in urls.items()}
    with prometheus(
        tmp_path / "prometheus",
        [*urls.values(), f"{monitor_url}/metrics"],  # the monitor: for its dead-run series
        rule_files=[RULES],
        target_labels=ranks,
        honor_labels=True,
    ) as server:
        # both watchers are up before the agents start, so both see the NaN step happen
        for run_id, run_faults in faults.items():
            settings = tiny_settings(
                runs,
                corpus_cache,
                run={"id": run_id},
                train={"max_steps": 10**7, "log_every": 5, "eval_every": 10**6},
                telemetry={"port": ports[run_id]},
                # one healthy state, before the NaNs (step 50): the test rolls back to it
                # (below), after the monitor's restart while the alert fires
                checkpoint={"every": 10**6, "keep_last": 5},
                snapshot={"every": 50},
                faults=run_faults,
            )
            agents[run_id] = start_agent(write_config(tmp_path / f"{run_id}.yaml", settings))
        theirs = PrometheusAlerts(server.url)
        try:
            # the NaN fault: fires in both, with the same labels
            nan_fired = wait_for(
                lambda: monitor_times(db, "firing", "LossNonFinite"), 120, "LossNonFinite"
            )
            ((nan_key, nan_at),) = nan_fired.items()
            assert dict(nan_key)["run_id"] == "nan" and dict(nan_key)["action"] == "rollback"
            wait_for(lambda: nan_key in theirs.fired, 30, "Prometheus firing LossNonFinite")
            assert abs(theirs.fired[nan_key] - nan_at) < AGREEMENT_S

            # an agent killed outright: down in both
            agents["victim"].send_signal(signal.SIGKILL)
            agents["victim"].wait()

            # the monitor killed mid-alert and restarted: same alert, nothing announced twice
            monitor.kill()
            monitor.wait()
            monitor = start_monitor(config)
            wait_for(lambda: firing_gauge(monitor_url, "LossNonFinite"), 60, "monitor back")
            nan_events = [
                e for e in alert_events(db) if e["labels"]["alertname"] == "LossNonFinite"
            ]
            assert [e["kind"] for e in nan_events] == ["pending", "firing"]

            # the victim is known dead in both: pending TrainingProcessDied (3m `for`)
            died = wait_for(
                lambda: monitor_times(db, "pending", "TrainingProcessDied"), 60, "process died"
            )
            (died_key,) = died
            died_labels = dict(died_key)
            assert (died_labels["run_id"], died_labels["exit"], died_labels["supervisor"]) == (
                "victim",
                "crashed",
                "none",
            )
            wait_for(lambda: died_key in theirs.pending, 30, "Prometheus: the victim died")

            # rolled back before the NaNs (which do not recur): LossNonFinite resolves in both
            with ControlClient(socket_path=runs / "nan" / SOCKET_NAME, timeout=60) as client:
                rolled = client.request("rollback", {"target": "last_good"})
            assert rolled["to_step"] == 50 and rolled["from_step"] >= 100
            resolved = wait_for(
                lambda: monitor_times(db, "resolved", "LossNonFinite"), 200, "NaN resolved"
            )
            assert last_good_step(ports["nan"]) >= 50
            wait_for(lambda: nan_key in theirs.ended, 30, "Prometheus resolving LossNonFinite")
            assert abs(theirs.ended[nan_key] - resolved[nan_key]) < AGREEMENT_S
            assert agents["nan"].poll() is None  # the NaN never stopped training
            fingerprints = {
                e["fingerprint"]
                for e in alert_events(db)
                if e["labels"]["alertname"] == "LossNonFinite"
            }
            assert len(fingerprints) == 1
            # the dead agent was never "down": in neither
            assert monitor_times(db, "firing", "LossguardAgentDown") == {}
            assert not [k for k in theirs.fired if ("alertname", "LossguardAgentDown") in k]
        finally:
            theirs.close()
            assert stop_processes(monitor, *agents.values())[0] == 0
