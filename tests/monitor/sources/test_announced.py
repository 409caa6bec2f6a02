"""Runs announced on the source (``lossguard_agent_info``): what the monitor believes, what it
refuses (counted, never acted on), how long it remembers, and how the actions reach a run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lossguard.monitor.actions.endpoints import Endpoints, NoEndpoint, NoSupervisor
from lossguard.monitor.actions.policy import ActionsConfig
from lossguard.monitor.promql import Sample, Value, make_labels
from lossguard.monitor.promql.model import label_value
from lossguard.monitor.sources import SourceError
from lossguard.monitor.sources.announced import HOSTS_QUERY, QUERY, AnnouncedRuns

TOKEN_ENV = "LOSSGUARD_CONTROL_TOKEN"


def info(run_id: str, instance: str, **labels: str) -> Sample:
    """Rank 0's ``lossguard_agent_info`` as Prometheus returns it (with its target labels)."""
    fields = {
        "__name__": "lossguard_agent_info",
        "job": "lossguard-agent",
        "instance": instance,
        "run_id": run_id,
        "rank": "0",
        "host": "node",
        "node": "0",
        "control": "",
        "supervisor": "",
        "protocol": "1",
    }
    return Sample(make_labels(fields | labels), 1.0)


class Source:
    """Answers the announcement queries with what a test puts in ``samples`` (rank 0's) and
    ``ranks`` (where the other ranks were scraped: run id and instance)."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []
        self.ranks: list[tuple[str, str]] = []
        self.failing = False
        self.asked: list[str] = []

    def query(self, expr: str, t: float) -> Value:
        self.asked.append(expr)
        if self.failing:
            raise SourceError("POST http://prometheus:9090/api/v1/query: connection refused")
        if expr == QUERY:
            return list(self.samples)
        assert expr == HOSTS_QUERY
        where = [
            (label_value(s.labels, "run_id"), label_value(s.labels, "instance"))
            for s in self.samples
        ]
        counts = Counter(where + self.ranks)
        return [
            Sample(make_labels({"run_id": run_id, "instance": instance}), float(n))
            for (run_id, instance), n in counts.items()
        ]


@pytest.fixture
def source() -> Source:
    return Source()


@pytest.fixture
def refused() -> Counter[str]:
    return Counter()


@pytest.fixture
def runs(refused: Counter[str]) -> AnnouncedRuns:
    return AnnouncedRuns(forget_after_s=60.0, refused=lambda reason: refused.update([reason]))


def test_a_run_is_learnt_from_its_announcement_and_forgotten_after_forget(
    source: Source, runs: AnnouncedRuns, refused: Counter[str]
) -> None:
    source.samples = [
        info("a", "10.0.0.5:9410", control="10.0.0.5:9420", supervisor="10.0.0.5:9421"),
        info("b", "10.0.0.6:9410", control="10.0.0.6:9420"),  # same port, another host
    ]
    runs.update(source.query, 100.0)
    assert source.asked == [QUERY, HOSTS_QUERY]
    a, b = runs.get("a"), runs.get("b")
    assert a is not None and a.control == ("10.0.0.5", 9420) and a.supervisor == ("10.0.0.5", 9421)
    assert b is not None and b.control == ("10.0.0.6", 9420) and b.supervisor is None
    assert runs.run_ids() == ["a", "b"] and not refused
    # a source that cannot answer changes nothing
    source.failing = True
    runs.update(source.query, 200.0)
    assert runs.run_ids() == ["a", "b"]
    # b's series is gone: remembered for forget_after_s after it was last seen, then forgotten
    source.failing = False
    source.samples = source.samples[:1]
    runs.update(source.query, 160.0)
    assert runs.run_ids() == ["a", "b"]
    runs.update(source.query, 161.0)
    assert runs.run_ids() == ["a"]


@pytest.mark.parametrize(
    ("labels", "instances", "reason"),
    [
        ({"protocol": "2", "control": "10.0.0.5:9420"}, ["10.0.0.5:9410"], "protocol"),
        ({"control": "10.0.0.5"}, ["10.0.0.5:9410"], "address"),
        ({"control": "10.0.0.5:99999"}, ["10.0.0.5:9410"], "address"),
        ({"supervisor": "no port:1"}, ["10.0.0.5:9410"], "address"),
        ({"control": "10.0.0.9:9420"}, ["10.0.0.5:9410"], "host"),
        ({"supervisor": "evil.invalid:9421"}, ["10.0.0.5:9410"], "host"),
        ({"control": "10.0.0.5:9420"}, ["10.0.0.5:9410", "10.0.0.7:9410"], "conflict"),
    ],
)
def test_an_announcement_that_cannot_be_acted_on_safely_is_refused_and_counted(
    source: Source,
    runs: AnnouncedRuns,
    refused: Counter[str],
    labels: dict[str, str],
    instances: list[str],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    source.samples = [info("a", instance, **labels) for instance in instances]
    runs.update(source.query, 100.0)
    runs.update(source.query, 101.0)
    assert runs.get("a") is None
    assert refused == Counter({reason: 2})
    lines = [r.getMessage() for r in caplog.records if "not believed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("run a: its announcement")


def test_a_supervisor_on_another_node_of_the_run_is_believed_elsewhere_not(
    source: Source, runs: AnnouncedRuns, refused: Counter[str]
) -> None:
    """Rank 0 landed on node 1 (10.0.0.6); node 0's supervisor (10.0.0.5) serves the run, and
    rank 1 was scraped there: believed. A supervisor on a host none of the run's ranks is on is
    refused."""
    source.samples = [
        info("a", "10.0.0.6:9410", control="10.0.0.6:9420", supervisor="10.0.0.5:9421"),
        info("b", "10.0.0.7:9410", control="10.0.0.7:9420", supervisor="10.0.0.9:9421"),
    ]
    source.ranks = [("a", "10.0.0.5:9410"), ("b", "10.0.0.8:9410")]
    runs.update(source.query, 100.0)
    a = runs.get("a")
    assert a is not None and a.supervisor == ("10.0.0.5", 9421) and a.control == ("10.0.0.6", 9420)
    assert runs.get("b") is None and refused == Counter(host=1)
    # rank 0's control must be on rank 0's own host, not merely one of the run's
    source.samples = [info("a", "10.0.0.6:9410", control="10.0.0.5:9420")]
    runs.update(source.query, 101.0)
    assert refused == Counter(host=2)


def test_actions_reach_the_announced_endpoints_and_the_map_overrides_them(
    source: Source, runs: AnnouncedRuns, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "a-control-token-0123456789")
    source.samples = [
        info("a", "10.0.0.5:9410", control="10.0.0.5:9420", supervisor="10.0.0.5:9421"),
        info("b", "10.0.0.6:9410", control="10.0.0.6:9420"),
    ]
    runs.update(source.query, 100.0)
    config = ActionsConfig(agents={"b": "10.0.0.8:7000"})
    endpoints = Endpoints(config, None, 5.0, runs)
    assert endpoints.client("a").address == "10.0.0.5:9420"
    assert endpoints.supervisor_client("a").address == "10.0.0.5:9421"
    assert endpoints.client("b").address == "10.0.0.8:7000"  # the configured override
    assert endpoints.ctl_target("a") == ["--tcp", "10.0.0.5:9420", "--token-env", TOKEN_ENV]
    assert endpoints.knows("a") and endpoints.knows("b") and not endpoints.knows("c")
    with pytest.raises(NoSupervisor, match="run b announces no supervisor"):
        endpoints.supervisor_client("b")
    # without the token in the environment nothing is sent: the action fails, saying why
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(
        NoEndpoint, match=f"run a is reached over TCP but \\${TOKEN_ENV} is not set"
    ):
        endpoints.client("a")


def test_a_configured_agent_address_that_is_not_host_port_is_refused() -> None:
    with pytest.raises(ValueError, match="r1: expected HOST:PORT, got 'gpu1'"):
        ActionsConfig(agents={"r1": "gpu1"})
    assert ActionsConfig(agents={"r1": "[::1]:9420"}).agents == {"r1": "[::1]:9420"}
