"""The compose stack of docs/deploy.md brought up natively from the same files (issue 14): Debian's
Prometheus with ``deploy/prometheus.yml`` laid out as in the container, Alertmanager with
``alerts/alertmanager.yml``, a monitor configured as ``deploy/monitor.yml`` (``file_sd_path``,
``triggers: [alertmanager]``, the token from the environment) and three tiny training runs:

* ``sup`` under ``lossguard-supervise``; its training process is SIGKILLed once (the supervisor
  restarts it from a checkpoint) and later sees NaN losses that keep coming, which Prometheus's
  LossNonFinite sends through Alertmanager to the monitor's webhook, and the monitor rolls it
  back;
* ``fp16`` (GradScaler on CPU) with a learning-rate divergence, so the spike detectors fire;
  its agent runs as if on a GPU that NVML knows (tests/support/fake_gpu_agent.py), so it exports
  NVML's series and ``lossguard_gpu_info``, which joins it with a stand-in DCGM exporter's series
  for that GPU (tests/support/dcgm_exporter.py, scraped as ``deploy/prometheus.yml``'s ``dcgm``
  job);
* ``fp8`` (torchao Float8Linear, emulated on CPU) with FP8 health sampling and the FP8
  fidelity check.

Then every query of every dashboard panel, template variable and annotation is evaluated
against the live Prometheus and must return data, every ``lossguard_*`` metric named by a
dashboard or a rule must exist in Prometheus (i.e. in a live scrape), and the rollback must have
come through the webhook. Only NVML's GPU series may be empty (:data:`NO_DATA_ON_CPU`).

The only change to the shipped files: ``deploy/prometheus.yml``'s 5 s scrape and evaluation
intervals become 1 s, and its ``monitor:9409``, ``alertmanager:9093`` and ``dcgm-exporter:9400``
(compose DNS names) become the test's ports; the monitor's paths and port, and Alertmanager's
webhook URL and secret files, are the test's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.support.amserver import AlertmanagerServer, alertmanager
from tests.support.dcgm_exporter import IDENTITY, dcgm_exposition
from tests.support.processes import (
    REPO,
    free_port,
    start_agent,
    start_monitor,
    stop_processes,
    supervisor_argv,
    wait_for,
)
from tests.support.promserver import (
    ExpositionServer,
    PromServer,
    prometheus_binary,
    running,
    web_config_flag,
)
from tests.support.runs import events, throttle, tiny_settings, write_config
from tests.support.webauth import WebAuth

pytestmark = pytest.mark.live

TOKEN_ENV = "LOSSGUARD_MONITOR_TOKEN"
TOKEN = "stack-test-token"
AUTH = WebAuth()  # Prometheus's and Alertmanager's basic auth, as in compose
DASHBOARDS = sorted((REPO / "dashboards" / "json").glob("*.json"))
RULES = REPO / "alerts" / "lossguard.rules.yml"
RUNS = ("sup", "fp16", "fp8")
NAN_STEP = 62  # sup: after the restart from step 30; checkpoints every 30 steps

# NVML series: the agents run on CPU, where there is no GPU to sample (DESIGN: "absent where
# there is no GPU"). These, and only these, may be empty; every query that may be empty must
# name one of them and nothing else from the agent.
NVML_METRICS = frozenset(
    {
        "lossguard_gpu_utilization_ratio",
        "lossguard_gpu_power_watts",
        "lossguard_gpu_temperature_celsius",
    }
)
NO_DATA_ON_CPU = {
    ("lossguard-run", "GPU utilisation"),
    ("lossguard-run", "GPU power and temperature"),
}

METRIC = re.compile(r"\blossguard_[a-z0-9_]+")
OTHER_GPU = "GPU-00000000-0000-0000-0000-000000000001"
DCGM_JOIN = (
    "DCGM_FI_DEV_POWER_USAGE * on(Hostname, gpu) group_left(run_id, rank) "
    "max by (Hostname, gpu, run_id, rank) (lossguard_gpu_info)"
)


@dataclass
class Stack:
    prom: PromServer
    am: AlertmanagerServer
    monitor_url: str
    runs: Path
    started: float


# ---------------------------------------------------------------------------- the stack


def prometheus_config(monitor: str, alertmanager_url: str, dcgm: str, password_file: Path) -> str:
    """deploy/prometheus.yml with 1 s intervals and the test's addresses and password file,
    otherwise unchanged."""
    text = shipped = (REPO / "deploy" / "prometheus.yml").read_text()
    replacements = {
        "scrape_interval: 5s": "scrape_interval: 1s",
        "evaluation_interval: 5s": "evaluation_interval: 1s",
        "'alertmanager:9093'": f"'{alertmanager_url.split('//')[1]}'",
        "'monitor:9409'": f"'{monitor.split('//')[1]}'",
        "'dcgm-exporter:9400'": f"'{dcgm}'",
        "/etc/prometheus/secrets/web-password": str(password_file),
    }
    for old, new in replacements.items():
        assert shipped.count(old) == 1, old
        text = text.replace(old, new)
    return text


def monitor_config(layout: Path, runs: Path, state: Path, port: int, alertmanager_url: str) -> Path:
    """deploy/monitor.yml with the test's paths, port and Alertmanager (where it posts its own
    alerts; rules: the same relative path)."""
    config = yaml.safe_load((REPO / "deploy" / "monitor.yml").read_text())
    assert config["actions"]["triggers"] == ["alertmanager"]
    assert config["listen"]["token_env"] == TOKEN_ENV
    config["scrape"]["runs_root"] = str(runs)
    config["scrape"]["file_sd_path"] = str(layout / "targets" / "lossguard.json")
    config["state"]["path"] = str(state)
    config["listen"].update(host="127.0.0.1", port=port)
    (hook,) = [r for r in config["notifications"]["receivers"] if r["name"] == "alertmanager"]
    assert hook["alertmanager_configs"][0]["url"] == "http://alertmanager:9093"
    hook["alertmanager_configs"][0]["url"] = alertmanager_url
    path = layout / "deploy" / "monitor.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def alertmanager_config(monitor_url: str, secrets: Path) -> dict[str, Any]:
    """alerts/alertmanager.yml with the monitor's webhook at ``monitor_url`` and its secret
    files (token, Slack URL, PagerDuty key) in ``secrets``."""
    text = (REPO / "alerts" / "alertmanager.yml").read_text()
    assert "http://monitor:9409/api/v1/alertmanager" in text
    text = text.replace("http://monitor:9409", monitor_url)
    text = text.replace("/etc/alertmanager/secrets/", f"{secrets}/")
    secrets.mkdir(parents=True)
    values = {
        "lossguard-monitor-token": TOKEN,
        "slack-webhook-url": "http://127.0.0.1:1/slack",  # refused: Alertmanager logs it
        "pagerduty-routing-key": "not-a-key",
    }
    for name, value in values.items():
        fd = os.open(secrets / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(value)
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def agent_settings(runs: Path, cache: Path, run_id: str, **sections: Any) -> dict[str, Any]:
    """A tiny run, 0.1 s a step at least, exporting on a free port (named in agent.json)."""
    sections = {"checkpoint": {"every": 10, "keep_last": 10, "async_save": False}, **sections}
    sections["faults"] = [throttle(0.1), *sections.get("faults", [])]
    return tiny_settings(
        runs,
        cache,
        run={"id": run_id},
        train={"max_steps": 10**7, "log_every": 5, "eval_every": 20, "eval_batches": 2},
        **sections,
    )


def start_prometheus(layout: Path, data: Path) -> PromServer:
    """Prometheus on the laid-out deploy/prometheus.yml, behind basic auth as in compose."""
    port = free_port()
    with open(layout / PromServer.LOG_FILE, "wb") as log:
        process = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={layout / 'deploy' / 'prometheus.yml'}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
                *web_config_flag(layout, AUTH),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return PromServer(process, port, layout, AUTH.pair)


def monitor_actions(monitor_url: str) -> list[dict[str, Any]]:
    try:
        reply = requests.get(f"{monitor_url}/api/v1/actions", timeout=5)
    except requests.ConnectionError:
        return []
    actions: list[dict[str, Any]] = reply.json()["data"]["actions"]
    return actions


def webhook_rollbacks(monitor_url: str) -> list[dict[str, Any]]:
    return [
        a
        for a in monitor_actions(monitor_url)
        if a["kind"] == "rollback"
        and a["state"] == "applied"
        and a["origin"] == "alertmanager"
        and a["run_id"] == "sup"
    ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, corpus_cache: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    started = time.time()
    layout = tmp / "etc"  # /etc/prometheus and /etc/lossguard in the containers
    (layout / "deploy").mkdir(parents=True)
    (layout / "targets").mkdir()
    shutil.copytree(REPO / "alerts", layout / "alerts")
    runs = tmp / "runs"
    runs.mkdir()

    settings = {
        "sup": agent_settings(
            runs,
            corpus_cache,
            "sup",
            telemetry={
                "host": "127.0.0.1",
                "port": 0,
                "grad_diagnostics": {"enabled": True, "every": 5},
            },
            checkpoint={"every": 30, "keep_last": 10, "async_save": False},
            # NaNs that keep coming from NAN_STEP (gone on the replay after the rollback):
            # LossNonFinite fires 40 steps into them; slower from just before them (the last
            # slow_step wins), so that the monitor's scrape keeps up
            faults=[
                {"kind": "nonfinite_loss", "step": NAN_STEP, "duration": 10**6, "once": True},
                throttle(0.2, from_step=NAN_STEP - 2),
            ],
        ),
        "fp16": agent_settings(
            runs,
            corpus_cache,
            "fp16",
            precision={"dtype": "fp16"},
            telemetry={
                "host": "127.0.0.1",
                "port": 0,
                "spikes": {"window": 32, "min_history": 16, "recover_steps": 5},
            },
            # a divergence the spike detectors see (not a NaN: that is not a spike)
            faults=[{"kind": "lr_scale", "step": 30, "duration": 3, "factor": 50, "once": True}],
        ),
        "fp8": agent_settings(
            runs,
            corpus_cache,
            "fp8",
            precision={"dtype": "fp8"},
            telemetry={
                "host": "127.0.0.1",
                "port": 0,
                "fp8": {"every": 2},
                "fp8_fidelity": {"enabled": True, "every": 2},
            },
        ),
    }
    configs = {name: write_config(tmp / f"{name}.yaml", s) for name, s in settings.items()}
    sup_dir = runs / "sup"
    agent_cmd = [sys.executable, "-m", "lossguard.agent.cli", "run", str(configs["sup"])]
    supervisor = subprocess.Popen(
        supervisor_argv(sup_dir, "--backoff", "1s", command=[*agent_cmd, "--no-progress"]),
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "supervisor.log", "wb"),  # noqa: SIM115
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    agents = [
        start_agent(configs["fp16"], module="tests.support.fake_gpu_agent"),
        start_agent(configs["fp8"]),
    ]
    # GPU 0 is fp16's (the stand-in NVML's UUID); GPU 1 trains nothing
    dcgm = ExpositionServer(dcgm_exposition(socket.gethostname(), [IDENTITY["UUID"], OTHER_GPU]))

    (tmp / "state").mkdir()
    port = free_port()
    monitor_url = f"http://127.0.0.1:{port}"
    monitors = []
    try:
        with alertmanager(
            tmp / "alertmanager", alertmanager_config(monitor_url, tmp / "secrets"), AUTH
        ) as am:
            config = monitor_config(layout, runs, tmp / "state" / "state.db", port, am.url)
            env = {TOKEN_ENV: TOKEN, "LOSSGUARD_WEB_PASSWORD": AUTH.password}
            monitors.append(start_monitor(config, env=env))
            password = AUTH.password_file(tmp / "secrets" / "web-password")
            (layout / "deploy" / "prometheus.yml").write_text(
                prometheus_config(monitor_url, am.url, dcgm.instance, password)
            )
            prom = start_prometheus(layout, tmp / "tsdb")
            with running(prom, "Prometheus", 30):
                # the SIGKILL: once sup has a checkpoint to restart from
                wait_for(
                    lambda: (sup_dir / "checkpoints" / "step_00000030").exists(),
                    90,
                    "sup's checkpoint at step 30",
                    interval=0.1,
                )
                child = json.loads((sup_dir / "agent.json").read_text())["pid"]
                os.kill(child, signal.SIGKILL)
                wait_for(
                    lambda: [e for e in events(sup_dir) if e.get("event") == "resumed"],
                    60,
                    "the supervisor's restart",
                    interval=0.1,
                )
                # the NaN -> Prometheus -> Alertmanager -> monitor webhook -> rollback
                wait_for(lambda: webhook_rollbacks(monitor_url), 90, "the rollback", interval=0.2)
                # the rollback's counter increase, scraped
                wait_for(
                    lambda: prom.api("query", query='lossguard_rollbacks_total{run_id="sup"} > 0')[
                        "result"
                    ],
                    20,
                    "the rollback in Prometheus",
                    interval=0.2,
                )
                # the FP8 run's health samples (FP8 on CPU is slow on a busy machine), scraped
                wait_for(
                    lambda: prom.api("query", query='lossguard_fp8_amax{run_id="fp8"}')["result"],
                    120,
                    "the fp8 run's FP8 health in Prometheus",
                    interval=0.5,
                )
                wait_for(
                    lambda: prom.api("query", query=DCGM_JOIN)["result"],
                    30,
                    "DCGM's series joined with fp16's GPU",
                    interval=0.5,
                )
                yield Stack(prom, am, monitor_url, runs, started)
    finally:
        dcgm.close()
        stop_processes(*monitors, *agents, supervisor, timeout=60)


# ---------------------------------------------------------------------------- the queries


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def substitute(expr: str) -> str:
    """Grafana's variables, as a dashboard showing every live run would set them."""
    runs = "|".join(RUNS)
    for name, value in (("run_id", runs), ("rank", ".*"), ("__rate_interval", "1m")):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, expr
    return expr


def dashboard_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard uid, where: panel title / annotation / variable, kind, query) of every
    dashboard; kind is target, annotation or variable."""
    found = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        uid = board["uid"]
        for panel in panels(board.get("panels", [])):
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    found.append((uid, panel["title"], "target", target["expr"]))
        for annotation in board.get("annotations", {}).get("list", []):
            if annotation.get("expr"):
                found.append((uid, annotation["name"], "annotation", annotation["expr"]))
        for variable in board.get("templating", {}).get("list", []):
            if variable["type"] == "datasource":
                assert variable["query"] == "prometheus", variable
            elif variable["type"] == "query":
                query = variable["query"]
                query = query["query"] if isinstance(query, dict) else query
                found.append((uid, variable["name"], "variable", query))
            else:
                raise AssertionError(f"{uid}: a variable of an unchecked type: {variable}")
    return found


def evaluate(stack: Stack, kind: str, query: str) -> list[Any]:
    """What Prometheus returns for a dashboard's query: an instant query now, else (a window
    that moved on) a range query over the test's time at a 1 s step; a variable's
    ``label_values(selector, label)`` through the label values API."""
    prom = stack.prom
    if kind == "variable":
        match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip())
        assert match, f"not a label_values() query: {query}"
        selector, label = substitute(match[1]), match[2]
        values: list[Any] = prom.api(f"label/{label}/values", **{"match[]": selector})
        return values
    expr = substitute(query)
    result: list[Any] = prom.api("query", query=expr)["result"]
    if not result:
        ranged = prom.api("query_range", query=expr, start=stack.started, end=time.time(), step=1)
        result = ranged["result"]
    return result


def has_data(result: list[Any]) -> bool:
    """Some series with a sample (NaN counts: a quantile of a histogram that did not move in
    the window is NaN, and Grafana draws the gap; the series is there)."""
    return any(isinstance(r, str) or r.get("value") is not None or r.get("values") for r in result)


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    queries = dashboard_queries()
    assert {uid for uid, *_ in queries} == {"lossguard-run", "lossguard-fleet", "lossguard-monitor"}
    # the allow-list holds NVML panels only, and each of their queries names NVML only
    for uid, where, _, query in queries:
        if (uid, where) in NO_DATA_ON_CPU:
            assert set(METRIC.findall(query)) <= NVML_METRICS, (uid, where, query)
    empty: list[str] = []

    def check() -> list[str]:
        empty.clear()
        for uid, where, kind, query in queries:
            if (uid, where) in NO_DATA_ON_CPU:
                continue
            if not has_data(evaluate(stack, kind, query)):
                empty.append(f"{uid} / {kind} {where!r}: {substitute(query)}")
        return [] if empty else ["ok"]

    # a counter that moved a moment ago may need one more scrape and evaluation
    try:
        wait_for(check, 20, "every query to return data", interval=1)
    except AssertionError:
        pytest.fail("queries without data:\n" + "\n".join(empty))
    # the variables: every live run, its rank
    by_name = {
        where: evaluate(stack, kind, q) for _, where, kind, q in queries if kind == "variable"
    }
    assert set(RUNS) <= set(by_name["run_id"]) and by_name["rank"] == ["0"]


def test_every_metric_named_exists_in_a_live_scrape(stack: Stack) -> None:
    """Every lossguard_* metric of the dashboards and the rules is in Prometheus (which has
    them only from its scrapes of the agents, the supervisor and the monitor)."""
    named: dict[str, set[str]] = {}
    for uid, _, _, query in dashboard_queries():
        for metric in METRIC.findall(query):
            named.setdefault(metric, set()).add(uid)
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            for metric in METRIC.findall(rule["expr"]):
                named.setdefault(metric, set()).add(RULES.name)
    live = set(stack.prom.api("label/__name__/values"))
    missing = {m: sorted(files) for m, files in named.items() if m not in live}
    for metric in NVML_METRICS:
        missing.pop(metric, None)
    assert not missing, f"named but never scraped: {missing}"
    assert len(named) > 40  # the check saw the dashboards' and the rules' names


def test_the_alertmanager_webhook_rolled_the_run_back(stack: Stack) -> None:
    (action, *_) = webhook_rollbacks(stack.monitor_url)
    assert action["alertname"] == "LossNonFinite"
    result = action["result"]
    assert result["from_step"] >= NAN_STEP and result["to_step"] < NAN_STEP
    rollbacks = [e for e in events(stack.runs / "sup") if e.get("event") == "rollback"]
    assert rollbacks and rollbacks[0]["to_step"] == result["to_step"]
    # the supervisor restarted the SIGKILLed process: crash and restart counted
    crashes = stack.prom.api("query", query='lossguard_supervisor_crashes_total{run_id="sup"}')
    assert [float(r["value"][1]) for r in crashes["result"]] == [1.0]
    restarts = stack.prom.api(
        "query", query='lossguard_supervisor_restarts_total{run_id="sup", reason="crash"}'
    )
    assert [float(r["value"][1]) for r in restarts["result"]] == [1.0]
    # the rollback went through the run's control socket with the monitor's request id
    commands = [e for e in events(stack.runs / "sup") if e.get("event") == "command"]
    assert [(c["cmd"], c["id"]) for c in commands] == [("rollback", action["id"])]
    # and announced: the monitor posted ActionTaken to Alertmanager, which routes it to Slack
    announced = wait_for(
        lambda: [a for a in stack.am.alerts() if a["labels"]["alertname"] == "ActionTaken"],
        30,
        "the announcement in Alertmanager",
        interval=0.2,
    )
    assert [a["labels"]["action_id"] for a in announced] == [action["id"]]
    assert [r["name"] for r in announced[0]["receivers"]] == ["slack-announcements"]


def test_dcgm_s_series_join_the_run_on_its_gpu(stack: Stack) -> None:
    """The stand-in DCGM exporter's GPU 0 is fp16's (same Hostname and gpu); GPU 1 trains
    nothing, so the join leaves it out."""
    joined = stack.prom.api("query", query=DCGM_JOIN)["result"]
    assert [
        (r["metric"]["run_id"], r["metric"]["rank"], r["metric"]["gpu"], r["metric"]["UUID"])
        for r in joined
    ] == [("fp16", "0", "0", IDENTITY["UUID"])]
    assert float(joined[0]["value"][1]) == 612.5
    (info,) = stack.prom.api("query", query='lossguard_gpu_info{run_id="fp16"}')["result"]
    assert info["metric"]["Hostname"] == socket.gethostname()
    assert info["metric"]["modelName"] == IDENTITY["modelName"]
    assert not stack.prom.api("query", query='ALERTS{alertname="GPUXidError"}')["result"]
