"""The routing tree: unit tests of matching, inheritance and group keys, and differential tests
of one non-trivial tree against the real Alertmanager 0.25: receivers and route keys against
``amtool config routes test --tree``, group keys and group labels against the webhook
messages of a running Alertmanager (amtool cannot show group keys)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lossguard.common.config import ConfigError
from lossguard.monitor.notify.config import RouteConfig
from lossguard.monitor.notify.matchers import Matcher
from lossguard.monitor.notify.routing import Route, build_route, label_set_string
from tests.support.amserver import alertmanager, amtool, capture_server, write_config
from tests.support.processes import wait_for

pytestmark = pytest.mark.live


def route(text: str) -> Route:
    return build_route(RouteConfig.model_validate(yaml.safe_load(text)))


def receivers(root: Route, labels: dict[str, str]) -> list[str]:
    return [r.receiver for r in root.match(labels)]


def walk(node: Route) -> Iterator[Route]:
    yield node
    for child in node.routes:
        yield from walk(child)


def test_defaults_and_inheritance() -> None:
    root = route(
        """
        receiver: default
        routes:
          - matchers: ['team="ml"']
            group_by: [run_id]
            group_wait: 10s
            routes:
              - matchers: ['severity="critical"']
                receiver: pager
                repeat_interval: 1h
          - matchers: ['team="web"']
            receiver: web
            group_interval: 1m
        """
    )
    assert (root.receiver, root.group_by, root.group_by_all) == ("default", (), False)
    assert (root.group_wait_s, root.group_interval_s, root.repeat_interval_s) == (30, 300, 14400)
    ml, web = root.routes
    pager = ml.routes[0]
    assert (ml.receiver, ml.group_by, ml.group_wait_s) == ("default", ("run_id",), 10)
    assert (pager.receiver, pager.group_by, pager.group_wait_s) == ("pager", ("run_id",), 10)
    assert (pager.group_interval_s, pager.repeat_interval_s) == (300, 3600)
    assert (web.group_by, web.group_wait_s, web.group_interval_s) == ((), 30, 60)


def test_group_by_all_and_empty_group_by() -> None:
    root = route(
        """
        receiver: r
        group_by: [alertname]
        routes:
          - matchers: [a=1]
            group_by: ['...']
            routes:
              - matchers: [b=1]
                group_by: []
              - matchers: [c=1]
                group_by: [c]
          - matchers: [d=1]
            group_by: []
        """
    )
    every, empty = root.routes
    inherits_all, own = every.routes
    assert every.group_by_all and inherits_all.group_by_all  # [] keeps the parent's grouping
    assert (own.group_by, own.group_by_all) == (("c",), False)
    assert (empty.group_by, empty.group_by_all) == (("alertname",), False)
    labels = {"a": "1", "b": "1", "alertname": "X", "run_id": "r", "blank": ""}
    assert every.group_labels(labels) == {"a": "1", "b": "1", "alertname": "X", "run_id": "r"}
    assert own.group_labels({"alertname": "X"}) == {}  # absent labels are left out
    assert root.group_labels(labels) == {"alertname": "X"}


def test_match_continue_and_fallback() -> None:
    root = route(
        """
        receiver: default
        routes:
          - receiver: first
            matchers: [a=1]
            continue: true
          - receiver: second
            matchers: [b=~"1|2"]
            routes:
              - receiver: deep
                matchers: [c!=""]
                routes:
                  - receiver: deeper
                    matchers: [d=1]
          - receiver: third
            matchers: [a=1]
          - receiver: never
            matchers: [a=1]
        """
    )
    assert receivers(root, {}) == ["default"]
    assert receivers(root, {"a": "1"}) == ["first", "third"]
    assert receivers(root, {"a": "1", "b": "2"}) == ["first", "second"]
    assert receivers(root, {"b": "1", "c": "x"}) == ["deep"]
    assert receivers(root, {"b": "1", "c": "x", "d": "1"}) == ["deeper"]
    assert receivers(root, {"b": "3"}) == ["default"]
    assert root.routes[1].match({"a": "1"}) == []  # a route that does not match: nothing


def test_keys_ids_and_group_keys() -> None:
    root = route(
        """
        receiver: r
        group_by: [alertname]
        routes:
          - matchers: ['team=~"ml|infra"', 'severity="critical"', 'a="x\\"y"']
            group_by: [a0, a]
            routes:
              - matchers: ['{z=1}']
          - matchers: [env=prod]
            continue: true
          - matchers: [env=prod]
        """
    )
    first, twin, twin2 = root.routes
    assert root.key == root.id == "{}"
    assert first.matchers == (  # sorted as Alertmanager sorts them
        Matcher("a", "=", 'x"y'),
        Matcher("severity", "=", "critical"),
        Matcher("team", "=~", "ml|infra"),
    )
    assert first.key == '{}/{a="x\\"y",severity="critical",team=~"ml|infra"}'
    assert first.routes[0].key == first.key + '/{z="1"}'
    assert (first.id, first.routes[0].id) == (first.key + "/0", first.key + '/{z="1"}/0')
    assert twin.key == twin2.key == '{}/{env="prod"}' and twin.id != twin2.id
    labels = {"a0": "w", "a": 'é\n"\\\x01\xa0', "alertname": "X"}
    # Prometheus's LabelSet.String(): "name=%q" sorted as text, so a0 comes before a.
    assert first.group_key(labels) == first.key + ':{a0="w", a="é\\n\\"\\\\\\x01\\u00a0"}'
    assert root.group_key(labels) == '{}:{alertname="X"}'
    assert root.routes[1].group_key({}) == '{}/{env="prod"}:{}'
    assert label_set_string({"b": "1", "a": "2"}) == '{a="2", b="1"}'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("group_by: [a, '...']", "route.group_by: '...' cannot be combined with label names"),
        ("group_by: [a-b]", "route.group_by: invalid label name 'a-b'"),
        ("group_by: [a, a]", "route.group_by: label 'a' is listed twice"),
        ("routes: [{group_interval: 0s}]", "route.routes.0.group_interval: cannot be zero"),
        ("routes: [{}, {repeat_interval: 0s}]", "route.routes.1.repeat_interval: cannot be zero"),
        ("continue: true", "route.continue: the root route cannot have continue"),
    ],
)
def test_config_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        route("receiver: r\n" + text)
    assert str(caught.value) == message


# ---------------------------------------------------------------- against Alertmanager

TREE: dict[str, Any] = {
    "receiver": "default",
    "group_by": ["alertname"],
    "group_wait": "0s",
    "routes": [
        {
            "receiver": "pager",
            "matchers": ['severity="critical"', 'team=~"ml|infra"'],
            "continue": True,
            "group_by": ["..."],
            "routes": [
                {"receiver": "pager-ml", "matchers": ["team=ml"], "group_by": ["run_id"]},
                {
                    "receiver": "pager-prod",
                    "matchers": ['{job!="", env!~"dev|test"}'],
                    "continue": True,
                },
                {"receiver": "pager-rest", "group_by": []},
            ],
        },
        {
            "receiver": "ml",
            "matchers": ['team="ml"'],
            "group_by": ["run_id", "alertname"],
            "routes": [
                {
                    "receiver": "ml-loss",
                    "matchers": ['alertname=~"Loss.*"', 'run_id!=""'],
                    "continue": True,
                    "routes": [
                        {
                            "receiver": "ml-spike",
                            "matchers": ['alertname="LossSpike"'],
                            "group_by": ["a0", "a", "run_id"],
                        }
                    ],
                },
                {"matchers": ['rank=~"[0-9]+"'], "group_by": ["rank"]},
                {"receiver": "ml-hw", "matchers": ['alertname=~"(GPU|NCCL).+"']},
            ],
        },
        {"receiver": "quiet", "matchers": ['severity!~"critical|warning"'], "continue": True},
        {"receiver": "odd", "matchers": ['msg="a, \\"b\\"\\\\c"', 'zone=~".*\\\\.eu"']},
        {"receiver": "prod-a", "matchers": ['env="prod"'], "continue": True},
        {"receiver": "prod-b", "matchers": ['env="prod"']},
    ],
}
ROOT = build_route(RouteConfig.model_validate(TREE))
RECEIVERS = sorted({r.receiver for r in walk(ROOT)})
ALERTNAMES = ["LossSpike", "LossNaN", "GPUHot", "NCCLTimeout", "DiskFull"]
VALUES = {
    "severity": ["critical", "warning", "info"],
    "team": ["ml", "infra", "web"],
    "env": ["prod", "dev", "test"],
    "job": ["trainer"],
    "run_id": ["r1", "r2"],
    "rank": ["0", "12", "x"],
    "msg": ['a, "b"\\c', "other"],
    "zone": ["x.eu", "xeu"],
    "a0": ["w"],
    "a": ['é\n"\\\x01\xa0'],
}
LABEL_SETS = st.fixed_dictionaries(
    {"alertname": st.sampled_from(ALERTNAMES)},
    optional={name: st.sampled_from(values) for name, values in VALUES.items()},
)
HAND_PICKED: list[dict[str, str]] = [
    {"alertname": "DiskFull"},
    {"alertname": "LossSpike", "severity": "critical", "team": "ml", "run_id": "r1", "a0": "w"},
    {"alertname": "LossNaN", "severity": "critical", "team": "infra", "job": "t", "env": "prod"},
    {"alertname": "LossNaN", "severity": "critical", "team": "infra", "job": "t", "env": "dev"},
    {"alertname": "GPUHot", "severity": "critical", "team": "infra"},
    {"alertname": "GPUHot", "severity": "warning", "team": "ml"},
    {"alertname": "NCCLTimeout", "team": "ml", "rank": "12"},
    {"alertname": "LossNaN", "team": "ml", "rank": "x"},
    {"alertname": "DiskFull", "severity": "warning", "msg": 'a, "b"\\c', "zone": "x.eu"},
    {"alertname": "DiskFull", "severity": "warning", "msg": 'a, "b"\\c', "env": "prod"},
    {"alertname": "DiskFull", "severity": "info", "env": "prod"},
    {"alertname": "LossSpike", "team": "ml", "run_id": "r2", "rank": "0", "a": VALUES["a"][0]},
]


def test_hand_picked_alerts_reach_every_route() -> None:
    reached = {r.id for labels in HAND_PICKED for r in ROOT.match(labels)}
    leaves = {r.id for r in walk(ROOT) if not r.routes}
    assert leaves <= reached, leaves - reached


@pytest.fixture(scope="module")
def amtool_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {"route": TREE, "receivers": [{"name": name} for name in RECEIVERS]}
    return write_config(tmp_path_factory.mktemp("amtool") / "am.yml", config)


TREE_PREFIXES = ("│\xa0\xa0 ", "    ", "├── ", "└── ")  # treeprint's indents


def amtool_routes(config: Path, labels: dict[str, str]) -> tuple[list[tuple[str, str]], str]:
    """(route key, receiver) of each route in ``amtool config routes test --tree``, and the
    receivers line it prints."""
    args = [str(Matcher(name, "=", value)) for name, value in labels.items()]
    done = amtool("config", "routes", "test", f"--config.file={config}", "--tree", *args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    end = lines.index("", 2)
    path: list[str] = []
    found = []
    for line in lines[2:end]:  # after "Matching routes:" and "."
        depth = 0
        while line[4 * depth : 4 * depth + 4] in TREE_PREFIXES:
            depth += 1
        node, _, receiver = line[4 * depth :].partition("  receiver: ")
        path = [*path[: depth - 1], "{}" if node == "default-route" else node]
        if receiver:
            found.append(("/".join(path), receiver))
    return found, next(line for line in lines[end:] if line)


def assert_routed_as_amtool(config: Path, labels: dict[str, str]) -> None:
    theirs, slug = amtool_routes(config, labels)
    ours = ROOT.match(labels)
    assert [(r.key, r.receiver) for r in ours] == theirs, labels
    assert ",".join(r.receiver for r in ours) == slug


@pytest.mark.parametrize("labels", HAND_PICKED)
def test_hand_picked_routing_as_amtool(amtool_config: Path, labels: dict[str, str]) -> None:
    assert_routed_as_amtool(amtool_config, labels)


@settings(max_examples=40, deadline=None)
@given(LABEL_SETS)
def test_generated_routing_as_amtool(amtool_config: Path, labels: dict[str, str]) -> None:
    assert_routed_as_amtool(amtool_config, labels)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(LABEL_SETS, min_size=10, max_size=30))
def test_group_keys_as_alertmanager(tmp_path: Path, drawn: list[dict[str, str]]) -> None:
    """Every (receiver, group key) Alertmanager notifies, with its group labels, is ours."""
    alerts = HAND_PICKED + drawn
    expected = {(r.receiver, r.group_key(labels)) for labels in alerts for r in ROOT.match(labels)}
    with capture_server() as sink:
        hook = {"url": sink.url("/"), "send_resolved": False}
        config = {
            "route": TREE,
            "receivers": [{"name": name, "webhook_configs": [hook]} for name in RECEIVERS],
        }
        with alertmanager(Path(tempfile.mkdtemp(dir=tmp_path)), config) as am:
            am.post_firing(alerts)

            def notified() -> set[tuple[str, str]]:
                return {(m["receiver"], m["groupKey"]) for m in sink.bodies("/")}

            wait_for(lambda: len(notified()) >= len(expected), 15, "a message for every group")
            assert notified() == expected
            messages = sink.bodies("/")
    for message in messages:
        for alert in message["alerts"]:
            labels = alert["labels"]
            ours = {(r.receiver, r.group_key(labels)): r for r in ROOT.match(labels)}
            matched = ours[message["receiver"], message["groupKey"]]
            assert matched.group_labels(labels) == message["groupLabels"]
