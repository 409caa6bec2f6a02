"""The deployment files (docker-compose.yml, deploy/, alerts/alertmanager.yml) checked with the
real tools, and the monitor's Prometheus ``file_sd`` output read by a real Prometheus laid out
as in the compose stack (docs/deploy.md)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.supervisor_file import SupervisorInfo
from lossguard.monitor.config import load_monitor_config
from lossguard.monitor.sources.file_sd import FileSdWriter
from tests.support.amserver import alertmanager, amtool
from tests.support.processes import (
    REPO,
    free_port,
    start_agent,
    start_monitor,
    stop_process,
    wait_for,
)
from tests.support.promserver import (
    PromServer,
    exposition_server,
    prometheus,
    prometheus_binary,
    running,
)
from tests.support.runs import tiny_settings, write_config, write_monitor_config
from tests.support.webauth import WebAuth

pytestmark = pytest.mark.live

HOST = socket.gethostname()
RULES = REPO / "alerts" / "lossguard.rules.yml"
PROMETHEUS_YML = REPO / "deploy" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "alerts" / "alertmanager.yml"


def write_agent(run_dir: Path, pid: int | None, *urls: str, **changes: object) -> Path:
    """``agent.json`` as the agent writes it (``changes``: e.g. a clean end)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    info = AgentInfo(run_dir.name, tuple(urls), None, time.time(), pid, HOST, len(urls), "test")
    data = {**json.loads(info.to_json()), **changes}
    (run_dir / "agent.json").write_text(json.dumps(data))
    return run_dir


def write_supervisor(run_dir: Path, pid: int, metrics_url: str, state: str = "running") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    info = SupervisorInfo(run_dir.name, pid, HOST, 1.0, state, metrics_url=metrics_url)  # type: ignore[arg-type]
    (run_dir / "supervisor.json").write_text(info.to_json())


def gone_pid() -> int:
    """The pid of a process that ran and was reaped."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# ---------------------------------------------------------------------------- the checks


def test_prometheus_config_passes_promtool() -> None:
    """Also checks the rule file it names (../alerts/lossguard.rules.yml, relative to the
    file: the same path in the repository and in the container)."""
    checked = subprocess.run(
        ["promtool", "check", "config", str(PROMETHEUS_YML)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = checked.stdout + checked.stderr
    assert checked.returncode == 0, out
    assert "SUCCESS: 1 rule files found" in out and "is valid prometheus config" in out, out
    # the only warning: the file_sd file is written by the monitor at run time
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert all("for file_sd" in line for line in warnings), out
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["lossguard-monitor"]["static_configs"][0]["targets"] == ["monitor:9409"]
    assert jobs["lossguard-discovered"]["honor_labels"] is True
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        "alertmanager:9093"
    ]


def test_alertmanager_config_routes_and_inhibits() -> None:
    checked = amtool("check-config", str(ALERTMANAGER_YML))
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    routes = {  # the three outcomes (docs/runbook.md): pages, announcements, nothing
        "alertname=TrainingProcessDied severity=critical": "pagerduty,slack",
        "alertname=ActionFailed severity=critical kind=rollback": "pagerduty,slack",
        "alertname=LossNonFinite action=rollback severity=info": "lossguard-monitor",
        "alertname=ActionTaken announce=once severity=info kind=rollback": "slack-announcements",
        "alertname=LossNonFiniteSkipped announce=once severity=info": "slack-announcements",
        "alertname=LossLevelShift severity=info": "nobody",
        "alertname=LowMFU severity=warning": "slack",
    }
    for labels, receivers in routes.items():
        tested = amtool(
            "config", "routes", "test", f"--config.file={ALERTMANAGER_YML}", *labels.split()
        )
        assert tested.stdout.strip() == receivers, (labels, tested.stdout, tested.stderr)
    config = yaml.safe_load(ALERTMANAGER_YML.read_text())
    (inhibit,) = config["inhibit_rules"]
    assert inhibit["source_matchers"] == ['severity="critical"']
    assert inhibit["target_matchers"] == ['severity="warning"'] and inhibit["equal"] == ["run_id"]
    (monitor,) = [r for r in config["receivers"] if r["name"] == "lossguard-monitor"]
    assert monitor["webhook_configs"][0]["url"] == "http://monitor:9409/api/v1/alertmanager"
    # no secret in the file: every one is a file the container writes from .env
    text = ALERTMANAGER_YML.read_text()
    for key in ("credentials_file", "api_url_file", "routing_key_file"):
        assert key in text
    assert "credentials:" not in text and "routing_key:" not in text and "api_url:" not in text


COMPOSE_SECRETS = {
    "LOSSGUARD_MONITOR_TOKEN": "not-a-secret",
    "LOSSGUARD_WEB_PASSWORD": "web-password",
    "LOSSGUARD_WEB_PASSWORD_HASH": "$2b$04$ly2/hBXI9pjy6mz7Ioj8ruF1fDHU3JrBhzh2U4.m3Vh.uXTVOa5ri",
    "GRAFANA_ADMIN_PASSWORD": "not-admin",
}


def compose_config(**env: str) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` with ``.env.example`` and ``env`` (an empty value: unset)."""
    environ = {k: v for k, v in {**os.environ, **env}.items() if v}
    return subprocess.run(
        ["docker-compose", "--env-file", str(REPO / ".env.example"), "config"],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_is_valid_and_safe_by_default() -> None:
    checked = compose_config(**COMPOSE_SECRETS)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # without any one of the secrets the stack refuses to start, naming it
    for name in COMPOSE_SECRETS:
        missing = compose_config(**{**COMPOSE_SECRETS, name: ""})
        assert missing.returncode != 0 and f"set {name} in .env" in missing.stderr, name
    services = yaml.safe_load(checked.stdout)["services"]
    assert {"prometheus", "alertmanager", "grafana", "monitor", "demo-agent"} <= set(services)
    # the control socket: one runs volume, one path, in the monitor and the agent
    assert (
        "runs:/runs"
        in yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["monitor"][
            "volumes"
        ]
    )
    for name, service in services.items():
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else f"{port['host_ip']}:{port['published']}"
            assert published.startswith("127.0.0.1:"), (name, port)
    commands = {name: " ".join(s.get("command") or []) for name, s in services.items()}
    assert "--web.enable-lifecycle" not in commands["prometheus"]
    for name in ("prometheus", "alertmanager"):
        assert "--web.config.file=" in commands[name] and "/etc/lossguard/web.yml" in commands[name]
    assert 'GF_SECURITY_ADMIN_PASSWORD" = admin' in commands["grafana"]
    env_example = (REPO / ".env.example").read_text()
    assert "GRAFANA_ADMIN_PASSWORD=\n" in env_example and "chmod 600 .env" in env_example


def test_the_web_config_passes_promtool_and_guards_both_servers(tmp_path: Path) -> None:
    auth = WebAuth()
    config = auth.web_config(tmp_path / "web.yml")
    checked = subprocess.run(
        ["promtool", "check", "web-config", str(config)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with (
        alertmanager(
            tmp_path / "am", {"route": {"receiver": "x"}, "receivers": [{"name": "x"}]}, auth
        ) as am,
        prometheus(tmp_path / "prom", alertmanagers=[am.url], web_auth=auth) as prom,
    ):
        for url in (f"{am.url}/api/v2/alerts", f"{prom.url}/api/v1/query?query=up"):
            assert requests.get(url, timeout=10).status_code == 401
            assert requests.get(url, auth=("lossguard", "wrong"), timeout=10).status_code == 401
            assert requests.get(url, auth=auth.pair, timeout=10).status_code == 200
        assert requests.post(f"{prom.url}/-/quit", auth=auth.pair, timeout=10).status_code == 403


def test_shipped_configs_load() -> None:
    """The monitor's and the demo agent's configs validate; Grafana's provisioning names the
    datasource uid the dashboards use and the mounted dashboards folder."""
    from lossguard.agent.config import load_config

    monitor = load_monitor_config(REPO / "deploy" / "monitor.yml")
    assert monitor.scrape.file_sd_path == Path("/var/lib/lossguard/targets/lossguard.json")
    assert monitor.rules.files[0].resolve() == RULES
    agent = load_config(REPO / "deploy" / "demo-agent.yaml")
    assert agent.faults and agent.telemetry.port == 9410
    grafana = REPO / "deploy" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((grafana / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["uid"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((grafana / "dashboards" / "lossguard.yml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


# ---------------------------------------------------------------------------- file_sd


def test_file_sd_has_live_runs_and_supervisors_only(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    out = tmp_path / "targets" / "lossguard.json"
    # runs on other hosts announce those hosts (discovery checks rank 0's URL against it)
    write_agent(
        runs / "big",
        os.getpid(),
        "http://gpu1:9410/metrics",
        "http://gpu1:9411/metrics",
        hostname="gpu1",
    )
    write_agent(runs / "dead", gone_pid(), "http://127.0.0.1:9412/metrics")
    write_agent(
        runs / "done",
        os.getpid(),
        "http://127.0.0.1:9413/metrics",
        exit="completed",
        finished_at=time.time(),
    )
    write_agent(runs / "other-path", None, "https://gpu2:9414/custom", hostname="gpu2")
    write_supervisor(runs / "big", os.getpid(), "http://127.0.0.1:9500/metrics")
    write_supervisor(runs / "done", gone_pid(), "http://127.0.0.1:9501/metrics")
    writer = FileSdWriter(out, runs, interval_s=1, forget_dead_after_s=3600)
    assert writer.write_once() is True
    groups = json.loads(out.read_text())
    assert groups == [
        {
            "targets": ["gpu1:9410"],
            "labels": {"job": "lossguard-agent", "run_id": "big", "rank": "0"},
        },
        {
            "targets": ["gpu1:9411"],
            "labels": {"job": "lossguard-agent", "run_id": "big", "rank": "1"},
        },
        {
            "targets": ["gpu2:9414"],
            "labels": {
                "job": "lossguard-agent",
                "run_id": "other-path",
                "rank": "0",
                "__metrics_path__": "/custom",
                "__scheme__": "https",
            },
        },
        {
            "targets": ["127.0.0.1:9500"],
            "labels": {"job": "lossguard-supervisor", "run_id": "big"},
        },
    ]
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert writer.write_once() is False  # nothing changed: not rewritten
    shutil.rmtree(runs / "big")
    assert writer.write_once() is True
    assert [g["labels"]["run_id"] for g in json.loads(out.read_text())] == ["other-path"]
    assert [p.name for p in out.parent.iterdir()] == ["lossguard.json"]  # no temporary left


def test_file_sd_path_needs_runs_root(tmp_path: Path) -> None:
    from lossguard.common.config import ConfigError

    config, _ = write_monitor_config(
        tmp_path / "monitor.yml",
        [RULES],
        scrape={"targets": ["http://127.0.0.1:1/metrics"], "file_sd_path": "sd.json"},
    )
    with pytest.raises(ConfigError, match="file_sd_path"):
        load_monitor_config(config)


def test_prometheus_scrapes_what_the_monitor_writes(tmp_path: Path) -> None:
    """The monitor (scrape.file_sd_path) and Prometheus with deploy/prometheus.yml, laid out as
    in the container (deploy/, alerts/, targets/ side by side): Prometheus scrapes the run's
    rank with job, run_id and rank from the file, and the monitor itself."""
    layout = tmp_path / "etc"
    (layout / "deploy").mkdir(parents=True)
    shutil.copytree(REPO / "alerts", layout / "alerts")
    runs = tmp_path / "runs"
    body = 'lossguard_step{run_id="r1",rank="0"} 42\n'
    with exposition_server(body) as agent:
        write_agent(runs / "r1", os.getpid(), agent.url)
        write_agent(runs / "gone", gone_pid(), "http://127.0.0.1:1/metrics")
        config, monitor_url = write_monitor_config(
            tmp_path / "monitor.yml",
            [RULES],
            scrape={"runs_root": str(runs), "file_sd_path": str(layout / "targets" / "lg.json")},
        )
        monitor = start_monitor(config)
        try:
            sd = layout / "targets" / "lg.json"
            wait_for(lambda: sd.exists() and "r1" in sd.read_text(), 30, "the file_sd file")
            assert "gone" not in sd.read_text()
            prom_config = yaml.safe_load(PROMETHEUS_YML.read_text())
            prom_config["global"]["scrape_interval"] = "1s"
            prom_config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [
                "127.0.0.1:1"
            ]
            for job in prom_config["scrape_configs"]:
                if job["job_name"] == "lossguard-monitor":
                    job["static_configs"][0]["targets"] = [monitor_url.split("//")[1]]
                job["scrape_interval"] = "1s"
            prom_file = layout / "deploy" / "prometheus.yml"
            prom_file.write_text(yaml.safe_dump(prom_config))
            port = free_port()
            log = open(layout / PromServer.LOG_FILE, "wb")  # noqa: SIM115
            process = subprocess.Popen(
                [
                    prometheus_binary(),
                    f"--config.file={prom_file}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            prom = PromServer(process, port, layout)
            with running(prom, "Prometheus", 30):

                def up() -> list[dict]:
                    result = prom.api("query", query="up == 1")["result"]
                    return result if len(result) == 2 else []

                result = wait_for(up, 30, "both targets up", interval=0.2)
                labels = sorted(
                    (r["metric"]["job"], r["metric"].get("run_id"), r["metric"].get("rank"))
                    for r in result
                )
                assert labels == [("lossguard-agent", "r1", "0"), ("lossguard-monitor", None, None)]
                step = prom.api("query", query='lossguard_step{job="lossguard-agent"}')["result"]
                assert [(s["metric"]["run_id"], s["value"][1]) for s in step] == [("r1", "42")]
                rules = prom.api("rules")["groups"]
                assert rules, "the shipped rule file is loaded"
            log.close()
        finally:
            stop_process(monitor)


def test_file_sd_follows_a_real_agent(tmp_path: Path, corpus_cache: Path) -> None:
    """A real tiny training run: its rank appears in the file with the port it bound, and
    leaves it when the run stops on purpose."""
    runs = tmp_path / "runs"
    settings = tiny_settings(runs, corpus_cache, train={"max_steps": 100_000, "log_every": 5})
    config = write_config(tmp_path / "agent.yaml", settings)
    out = tmp_path / "targets" / "lossguard.json"
    writer = FileSdWriter(out, runs, interval_s=1, forget_dead_after_s=3600)
    agent = start_agent(config)
    try:

        def listed() -> list[dict]:
            writer.write_once()
            return json.loads(out.read_text())

        (group,) = wait_for(listed, 120, "the agent in the file_sd file", interval=0.2)
        info = AgentInfo.parse((runs / "tiny" / "agent.json").read_bytes())
        assert group["labels"] == {"job": "lossguard-agent", "run_id": "tiny", "rank": "0"}
        (target,) = group["targets"]
        assert info.metrics_urls[0].startswith(f"http://{target}/")
        reply = requests.get(f"http://{target}/metrics", timeout=10)
        assert 'run_id="tiny"' in reply.text
    finally:
        agent.terminate()
        agent.communicate(timeout=120)
    writer.write_once()
    assert json.loads(out.read_text()) == []
