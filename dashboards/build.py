"""lossguard's Grafana dashboards as code (grafana-foundation-sdk): ``python -m dashboards.build``
writes ``dashboards/json/<uid>.json`` for the run, fleet and monitor dashboards (one module
each: ``run`` with ``run_stability``, ``fleet``, ``monitor``; ``panels`` holds what they are
built from). Every query reads a Prometheus datasource variable, ``${datasource}``, that
provisioning binds; every metric name is one of the catalogues' (common/catalogue.py,
monitor/metrics.py, supervisor/metrics.py), which tests/dashboards/test_build.py checks, along with
the committed JSON being current."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards.fleet import fleet_dashboard
from dashboards.monitor import monitor_dashboard
from dashboards.panels import JSON_DIR
from dashboards.run import run_dashboard

DASHBOARDS = {
    "lossguard-run": run_dashboard,
    "lossguard-fleet": fleet_dashboard,
    "lossguard-monitor": monitor_dashboard,
}


def render(builder: db.Dashboard) -> str:
    """The dashboard's JSON, panels numbered in order, keys sorted: stable across runs."""
    model = builder.build()
    for number, panel in enumerate(model.panels or [], start=1):
        panel.id_val = number
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(directory: Path = JSON_DIR) -> list[Path]:
    """Write every dashboard as ``<uid>.json`` under ``directory``; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid, make in DASHBOARDS.items():
        path = directory / f"{uid}.json"
        path.write_text(render(make()), encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=JSON_DIR, help="directory (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(path)


if __name__ == "__main__":
    main()
