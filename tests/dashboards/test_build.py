"""The Grafana dashboards (dashboards/build.py): the committed JSON is what the generator writes,
every metric a query names is in a catalogue, and every panel has a unit and a description."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lossguard.common import catalogue
from lossguard.monitor import metrics as monitor_metrics
from lossguard.supervisor import metrics as supervisor_metrics

pytestmark = pytest.mark.live

JSON_DIR = Path(__file__).resolve().parents[2] / "dashboards" / "json"
UIDS = ("lossguard-run", "lossguard-fleet", "lossguard-monitor")
METRIC = re.compile(r"\blossguard_[a-z0-9_]+")
SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def exposed_names() -> set[str]:
    """Every series name the catalogues export, as scraped (counters with _total, histograms
    with _bucket, _sum and _count)."""
    tables = [
        (catalogue.PREFIX, catalogue.CATALOGUE),
        (monitor_metrics.PREFIX, monitor_metrics.CATALOGUE),
        ("", monitor_metrics.RUN_CATALOGUE),
        (supervisor_metrics.PREFIX, supervisor_metrics.CATALOGUE),
    ]
    return {
        prefix + name + suffix
        for prefix, entries in tables
        for name, (kind, _, _) in entries.items()
        for suffix in SUFFIXES[kind]
    }


def committed(uid: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((JSON_DIR / f"{uid}.json").read_text("utf-8"))
    return result


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but rows, nested ones included."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def expressions(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression: panel targets, variable queries and annotations."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["query"]
    for annotation in dashboard["annotations"].get("list", []):
        if "expr" in annotation:
            yield annotation["expr"]


def test_committed_json_is_current(tmp_path: Path) -> None:
    from dashboards import build

    written = build.write(tmp_path)
    assert sorted(path.name for path in written) == sorted(f"{uid}.json" for uid in UIDS)
    for path in written:
        current = JSON_DIR / path.name
        assert current.read_bytes() == path.read_bytes(), (
            f"{current} is stale: run python -m dashboards.build"
        )


def test_uids() -> None:
    assert sorted(path.stem for path in JSON_DIR.glob("*.json")) == sorted(UIDS)
    for uid in UIDS:
        assert committed(uid)["uid"] == uid


@pytest.mark.parametrize("uid", UIDS)
def test_every_metric_is_in_a_catalogue(uid: str) -> None:
    known = exposed_names()
    exprs = list(expressions(committed(uid)))
    assert exprs
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used
    assert used <= known, f"not in any catalogue: {sorted(used - known)}"
    # descriptions name metrics too
    described = {
        name for panel in panels(committed(uid)) for name in METRIC.findall(panel["description"])
    }
    assert described <= known, f"not in any catalogue: {sorted(described - known)}"


@pytest.mark.parametrize("uid", UIDS)
def test_every_panel_has_unit_description_and_datasource(uid: str) -> None:
    for panel in panels(committed(uid)):
        assert panel.get("description"), panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_run_dashboard_variables_and_annotations() -> None:
    dashboard = committed("lossguard-run")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run_id"]["query"] == "label_values(lossguard_step, run_id)"
    assert variables["run_id"]["multi"] is True
    assert "rank" in variables
    annotations = " ".join(a["expr"] for a in dashboard["annotations"]["list"])
    for name in ("lossguard_spikes_total", "lossguard_rollbacks_total", "ALERTS{"):
        assert name in annotations


def test_fleet_links_to_the_run_dashboard() -> None:
    (table,) = panels(committed("lossguard-fleet"))
    urls = [link["url"] for link in table["fieldConfig"]["defaults"]["links"]]
    assert urls == ["/d/lossguard-run?var-run_id=${__data.fields.run_id}"]


GRAFANA_VARIABLES = {"$run_id": ".*", "$rank": ".*", "$__rate_interval": "1m"}


def promql(expr: str) -> str:
    """``expr`` with the dashboard variables replaced the way Grafana would (All = .*)."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def test_every_query_parses(tmp_path: Path) -> None:
    """Prometheus' own parser accepts every query (as recording rules; label_values() is a
    Grafana function, so its selector is checked)."""
    exprs = []
    for uid in UIDS:
        for expr in expressions(committed(uid)):
            match = re.fullmatch(r"label_values\((.+), \w+\)", expr)
            exprs.append(promql(match.group(1) if match else expr))
    rules = {
        "groups": [
            {
                "name": "dashboards",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "queries.rules.yml"
    path.write_text(json.dumps(rules), encoding="utf-8")
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
