"""The monitor's HTTP API for scripts and dashboards (docs/monitor.md, "HTTP API"): read-only
views of the runs, their checkpoints, the alerts and the actions, under ``/api/v1/``; the one
verb that changes anything, ``POST /api/v1/runs/{run_id}/control``, is in
:mod:`lossguard.monitor.http.control`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.targets import NAMED_TARGETS, is_superseded, ordered
from lossguard.monitor.actions.endpoints import Endpoints
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.http.control import control_route
from lossguard.monitor.http.messages import Request, Response, Routes, api_data, api_error
from lossguard.monitor.runs import RunsView, read_runs
from lossguard.monitor.views import action_json, active_alerts

RUNS_PATH = "/api/v1/runs"
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def api_routes(
    runs: RunsView,
    state: AlertStore,
    endpoints: Endpoints,
    *,
    token: str | None,
    token_env: str,
) -> Routes:
    """The ``/api/v1/`` endpoints; control needs ``token`` (None: control is refused, saying
    how to set ``$token_env``)."""
    actions = ActionStore(state)

    def list_runs(request: Request) -> Response:
        return api_data({"runs": runs.runs()})

    def one_run(request: Request) -> Response:
        run_id = request.params["run_id"]
        found = runs.runs(run_id)
        if not found:
            return api_error(404, f"run {run_id!r} is not known to the monitor")
        return api_data(found[0])

    def checkpoints(request: Request) -> Response:
        run_id = request.params["run_id"]
        files = read_runs(runs.runs_root).get(run_id)
        if files is None:
            return api_error(
                404,
                f"run {run_id!r}: no run directory known to the monitor (no agent.json under "
                "scrape.runs_root names it)",
            )
        return api_data(
            {"run_id": run_id, **checkpoint_list(RunPaths.of(files.run_dir).checkpoints)}
        )

    def alerts(request: Request) -> Response:
        return api_data({"alerts": active_alerts(state)})

    def list_actions(request: Request) -> Response:
        run_id = _query_value(request, "run_id")
        limit = _query_value(request, "limit")
        if run_id == "":
            return api_error(400, "run_id: must not be empty")
        count = DEFAULT_LIMIT if limit is None else _count(limit)
        if count is None:
            return api_error(400, f"limit: must be an integer from 1 to {MAX_LIMIT}, not {limit!r}")
        if run_id is None:
            found = actions.recent(count)
        else:
            found = actions.of_run(run_id, since=0.0)[::-1][:count]
        return api_data({"actions": [action_json(r) for r in found]})

    return {
        ("GET", RUNS_PATH): list_runs,
        ("GET", f"{RUNS_PATH}/{{run_id}}"): one_run,
        ("GET", f"{RUNS_PATH}/{{run_id}}/checkpoints"): checkpoints,
        ("GET", "/api/v1/alerts"): alerts,
        ("GET", "/api/v1/actions"): list_actions,
        ("POST", f"{RUNS_PATH}/{{run_id}}/control"): control_route(
            runs.runs_root, endpoints, token=token, token_env=token_env
        ),
    }


def checkpoint_list(root: Path) -> dict[str, Any]:
    """The checkpoints under ``root`` in creation order, each with the targets it answers
    (``marks``), and the names of the latest, best and last good one (None: there is none)."""
    metas = list_checkpoints(root)
    named = {target: next(iter(ordered(metas, target)), None) for target in NAMED_TARGETS}
    names = {target: meta.name if meta else None for target, meta in named.items()}
    return {
        **names,
        "checkpoints": [
            {
                **meta.to_dict(),
                "superseded": is_superseded(meta),
                "marks": [target for target, name in names.items() if name == meta.name],
            }
            for meta in metas
        ],
    }


def _query_value(request: Request, name: str) -> str | None:
    """The first value of query parameter ``name`` (None: not given)."""
    values = request.query.get(name)
    return values[0] if values else None


def _count(text: str) -> int | None:
    """``text`` as a limit in 1..MAX_LIMIT (None: not one)."""
    if not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if 1 <= value <= MAX_LIMIT else None
