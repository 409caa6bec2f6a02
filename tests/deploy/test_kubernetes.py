"""deploy/kubernetes/: every object valid against the Kubernetes API schemas (the
``kubernetes-validate`` package, offline), the Job's podFailurePolicy mapping the exit-code
contract, and the files they embed accepted by the tools that read them (lossguard-supervise's
arguments, the agent's and the monitor's configurations, ``promtool check config``). No static
map: the monitor reads Prometheus and finds the runs' control endpoints on
``lossguard_agent_info``, which the training pods advertise at their pod IP."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from lossguard.agent.cli import build_parser as agent_parser
from lossguard.agent.config import parse_config
from lossguard.common.control.address import split_address
from lossguard.common.exitcodes import EXIT_CONFIG, EXIT_PERMANENT, EXIT_PREEMPTED, EXIT_STOPPED
from lossguard.monitor.config import load_monitor_config
from lossguard.monitor.promql import Sample, make_labels
from lossguard.monitor.sources.announced import AGENT_INFO, HOSTS_QUERY, QUERY, AnnouncedRuns
from lossguard.supervisor.cli import build_parser
from lossguard.supervisor.multinode import placement
from tests.support.processes import REPO

pytestmark = pytest.mark.live

KUBERNETES = REPO / "deploy" / "kubernetes"
VERSION = "1.31.0"  # podFailurePolicy is GA from 1.31


def objects() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(KUBERNETES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def named(kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name)


@pytest.mark.parametrize("obj", objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_is_valid_against_the_api_schema(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, VERSION, strict=True)


def test_an_invalid_object_is_refused() -> None:
    job = named("Job", "lossguard-train")
    broken = yaml.safe_load(yaml.safe_dump(job))
    broken["spec"]["podFailurePolicy"]["rules"][0]["action"] = 138
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_the_pod_failure_policy_maps_the_exit_code_contract() -> None:
    spec = named("Job", "lossguard-train")["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    disrupted = {"type": "DisruptionTarget", "status": "True"}
    assert rules[0] == {"action": "Ignore", "onPodConditions": [disrupted]}
    by_action = {r["action"]: set(r["onExitCodes"]["values"]) for r in rules[1:]}
    assert by_action == {
        "Ignore": {EXIT_PREEMPTED},
        "FailJob": {EXIT_PERMANENT, EXIT_CONFIG, EXIT_STOPPED},
    }
    container = spec["template"]["spec"]["containers"][0]
    assert all(r["onExitCodes"]["containerName"] == container["name"] for r in rules[1:])
    assert spec["template"]["spec"]["restartPolicy"] == "Never"


POD_IP = "10.42.3.17"  # what the Downward API gives a pod (status.podIP)
SET_BY_THE_JOB = {"JOB_COMPLETION_INDEX"}  # set in every pod of an Indexed Job


def train_container() -> dict[str, Any]:
    return named("Job", "lossguard-train")["spec"]["template"]["spec"]["containers"][0]


def expanded_argv(container: dict[str, Any], **values: str) -> list[str]:
    """The container's command line as Kubernetes runs it: each ``$(NAME)`` replaced by the
    variable's value. Every variable it names is one of the container's or the Job's."""
    defined = {e["name"] for e in container["env"]} | SET_BY_THE_JOB
    argv = [*container["command"], *container["args"]]
    names = {name for a in argv for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a)}
    assert names <= defined, f"undefined in the pod: {names - defined}"
    assert names <= set(values), f"give the test a value for {names - set(values)}"
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], a) for a in argv]


def supervisor_and_agent_argv(
    container: dict[str, Any], **values: str
) -> tuple[list[str], list[str]]:
    """lossguard-supervise's arguments, and the agent's (after ``-m lossguard.agent.cli``)."""
    argv = expanded_argv(container, **values)
    module = argv.index("lossguard.agent.cli")
    assert argv[module - 1] == "-m"
    return argv[1:], argv[module + 1 :]


def test_the_training_pod_runs_a_supervisor_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = named("Job", "lossguard-train")["spec"]
    container = spec["template"]["spec"]["containers"][0]
    supervisor, agent = supervisor_and_agent_argv(
        container, JOB_COMPLETION_INDEX="1", POD_IP=POD_IP
    )
    args = build_parser().parse_args(supervisor)
    command = tuple(args.cmd[1:])
    assert args.give_up and args.term_is_preemption
    where = placement(command, args.node_rank, args.nnodes, env={})
    assert (where.node, where.nnodes) == (1, spec["completions"]) == (1, spec["parallelism"])
    master = next(a for a in command if a.startswith("--master-addr="))
    service = named("Service", "lossguard-train")
    assert master == f"--master-addr=lossguard-train-0.{service['metadata']['name']}"
    token = next(e for e in container["env"] if e["name"] == "LOSSGUARD_CONTROL_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "lossguard"
    monkeypatch.setenv("LOSSGUARD_CONTROL_TOKEN", "from-the-secret-" + "0" * 16)
    agent_args = agent_parser().parse_args(agent)
    train = yaml.safe_load(named("ConfigMap", "lossguard-train")["data"]["train.yaml"])
    config = parse_config(train, agent_args.overrides)
    assert f"{config.run.dir}/{config.run.id}" == args.run_dir.as_posix()


def test_the_training_pods_advertise_their_control_at_the_pod_ip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's control (the agent's control.advertise) and the supervisor's
    (--control-advertise) are announced at the pod's IP from the Downward API: the host of the
    ``instance`` label kubernetes_sd gives the pod's exporters, the only host the monitor
    believes an announced endpoint on."""
    container = train_container()
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    supervisor, agent = supervisor_and_agent_argv(
        container, JOB_COMPLETION_INDEX="0", POD_IP=POD_IP
    )
    args = build_parser().parse_args(supervisor)
    assert args.control_tcp == "0.0.0.0:9421"
    assert args.control_advertise == f"{POD_IP}:9421"
    assert args.token_env == "LOSSGUARD_CONTROL_TOKEN"
    token = next(e for e in container["env"] if e["name"] == args.token_env)
    assert token["valueFrom"]["secretKeyRef"] == {"name": "lossguard", "key": "control-token"}
    monkeypatch.setenv(args.token_env, "from-the-secret-" + "0" * 16)
    agent_args = agent_parser().parse_args(agent)
    train = yaml.safe_load(named("ConfigMap", "lossguard-train")["data"]["train.yaml"])
    control = parse_config(train, agent_args.overrides).control
    assert control.token_env == args.token_env
    assert split_address(control.tcp or "") == ("0.0.0.0", 9420)
    assert control.advertise == f"{POD_IP}:9420"
    ports = {p["containerPort"]: p["name"] for p in container["ports"]}
    assert ports[9420] == "control" and ports[9421] == "control-sup"
    # the monitor believes what a pod announces: the instance Prometheus scraped it at is
    # POD_IP:PORT (kubernetes_sd, role pod, no relabelling of the address)
    refused: list[str] = []
    runs = AnnouncedRuns(600, refused.append)
    info = {
        "__name__": AGENT_INFO,
        "instance": f"{POD_IP}:9410",
        "job": "lossguard-agent",
        "run_id": "gpt",
        "rank": "0",
        "control": control.advertise,
        "supervisor": args.control_advertise,
        "protocol": "1",
    }
    queries: list[str] = []

    def query(expr: str, t: float) -> list[Sample]:
        queries.append(expr)
        return [Sample(make_labels(info), 1.0)]

    runs.update(query, 100.0)
    assert queries == [QUERY, HOSTS_QUERY] and refused == []
    run = runs.get("gpt")
    assert run is not None
    assert (run.control, run.supervisor) == ((POD_IP, 9420), (POD_IP, 9421))
    # the same announcement scraped from another pod's address is refused
    info["instance"] = "10.42.9.9:9410"
    AnnouncedRuns(600, refused.append).update(query, 100.0)
    assert refused == ["host"]


def test_the_monitor_config_loads(tmp_path: Path) -> None:
    data = named("ConfigMap", "lossguard-monitor")["data"]
    (tmp_path / "lossguard.rules.yml").write_text((REPO / "alerts/lossguard.rules.yml").read_text())
    (tmp_path / "monitor.yml").write_text(data["monitor.yml"])
    config = load_monitor_config(tmp_path / "monitor.yml")
    assert config.listen.token_env == "LOSSGUARD_MONITOR_TOKEN"
    monitor = named("Deployment", "lossguard-monitor")["spec"]["template"]["spec"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in monitor["containers"][0]["env"]}
    secret = named("Secret", "lossguard")["stringData"]
    assert {ref["key"] for ref in env.values()} <= set(secret)
    # no static map: the runs and their endpoints come from the in-cluster Prometheus
    assert config.source == "prometheus" and config.prometheus is not None
    assert re.fullmatch(
        r"http://[a-z0-9-]+\.[a-z0-9-]+\.svc(\.cluster\.local)?:\d+", config.prometheus.url
    )
    assert "agents" not in yaml.safe_load(data["monitor.yml"])["actions"]
    assert config.actions.agents == {} and config.scrape.runs_root is None
    # the control token the training pods get (their Secret key) is the monitor's
    train = {e["name"]: e.get("valueFrom") for e in train_container()["env"]}
    assert env[config.actions.token_env] == train["LOSSGUARD_CONTROL_TOKEN"]["secretKeyRef"]
    mounts = {m["mountPath"] for m in monitor["containers"][0]["volumeMounts"]}
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in monitor["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert mounts == {"/var/lib/lossguard", "/etc/lossguard"}  # its state and its config
    assert claims == {"lossguard-monitor-state"}  # not the runs volume


POD_META = {  # kubernetes_sd_configs role pod: the meta labels the relabelling reads
    "__meta_kubernetes_pod_annotation_prometheus_io_scrape",
    "__meta_kubernetes_pod_container_port_name",
    "__meta_kubernetes_pod_label_lossguard_dev_run_id",
    "__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index",
    "__meta_kubernetes_pod_label_app_kubernetes_io_name",
    "__meta_kubernetes_pod_name",
}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_the_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """Debian's Prometheus is built without Kubernetes discovery, so promtool checks the rest
    (relabelling, rule files) with each ``kubernetes_sd_configs`` swapped for a file_sd."""
    text = named("ConfigMap", "lossguard-prometheus")["data"]["prometheus.yml"]
    prometheus = yaml.safe_load(text)
    rules = tmp_path / "lossguard.rules.yml"
    rules.write_text((REPO / "alerts/lossguard.rules.yml").read_text())
    prometheus["rule_files"] = [str(rules)]
    labels = set()
    for job in prometheus["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
        labels |= {label for r in job["relabel_configs"] for label in r["source_labels"]}
        # instance stays POD_IP:PORT, the host the monitor checks announced endpoints against
        targets = {r.get("target_label") for r in job["relabel_configs"]}
        assert not targets & {"__address__", "instance"}, job["job_name"]
    assert labels <= POD_META
    # as deploy/prometheus.yml: the run_id, rank and node the exporters expose win
    honored = {j["job_name"]: j.get("honor_labels", False) for j in prometheus["scrape_configs"]}
    assert honored == {
        "lossguard-agent": True,
        "lossguard-supervisor": True,
        "lossguard-monitor": False,
    }
    (tmp_path / "targets.json").write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus))
    done = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def pod_specs() -> list[dict[str, Any]]:
    return [o["spec"]["template"]["spec"] for o in objects() if o["kind"] in ("Job", "Deployment")]


def test_every_pod_runs_unprivileged() -> None:
    """Non-root (the images' user), no privilege escalation, no capabilities, a read-only root
    filesystem (writes go to volumes), the runtime's seccomp profile."""
    specs = pod_specs()
    assert len(specs) == 2
    for spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001  # deploy/*.Dockerfile's user
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}
    for dockerfile in ("agent", "monitor"):
        assert "--uid 10001" in (REPO / f"deploy/{dockerfile}.Dockerfile").read_text()


def test_network_policies_admit_only_prometheus_the_monitor_and_the_run() -> None:
    """The agent's control and exporters and the monitor listen on 0.0.0.0: a policy per pod
    kind admits only their peers."""
    train = named("NetworkPolicy", "lossguard-train")["spec"]
    assert train["podSelector"]["matchLabels"] == {"job-name": "lossguard-train"}
    sources = {
        frozenset(peer["podSelector"]["matchLabels"].items()): sorted(
            (p["port"], p.get("endPort", p["port"])) for p in rule.get("ports", [{"port": 0}])
        )
        for rule in train["ingress"]
        for peer in rule["from"]
    }
    exporters = (9410, 9417)  # 9410 + local rank, 8 ranks a pod
    assert sources == {
        frozenset({("job-name", "lossguard-train")}): [(0, 0)],  # every port
        # rank 0's and the supervisor's control; it reads the metrics from Prometheus
        frozenset({("app.kubernetes.io/name", "lossguard-monitor")}): [(9420, 9420), (9421, 9421)],
        frozenset({("app.kubernetes.io/name", "prometheus")}): [(9408, 9408), exporters],
    }
    monitor = named("NetworkPolicy", "lossguard-monitor")["spec"]
    (rule,) = monitor["ingress"]
    peers = [peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for peer in rule["from"]]
    assert peers == ["prometheus", "alertmanager"] and rule["ports"] == [{"port": 9409}]
    assert all(peer["namespaceSelector"] == {} for peer in rule["from"])  # any namespace
    assert train["policyTypes"] == monitor["policyTypes"] == ["Ingress"]
