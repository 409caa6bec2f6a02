"""``lossguard-monitor report``: reading run directories as they really are (a user's own loop
without telemetry, a crashed run with a torn last line, a folder that is no run), the monitor's
alerts and actions from its state database, and the command's output and errors."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.config import parse_config
from lossguard.common.rundir.jsonl import read_jsonl
from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.report import ReportError, marks, write_report
from lossguard.monitor.report.data import Point, RunRecord, read_run
from lossguard.monitor.report.figures import draw_loss
from lossguard.monitor.rules.alerting import (
    Alert,
    AlertState,
    Transition,
    TransitionKind,
    fingerprint,
)
from tests.support.processes import monitor_cli, start_agent
from tests.support.runs import tiny_settings, write_config

pytestmark = pytest.mark.live

SVG_ID = re.compile(r'id="([a-z][a-z0-9_.-]*)"')


def svg_ids(html: Path) -> set[str]:
    return set(SVG_ID.findall(html.read_text(encoding="utf-8")))


def own_loop_run(run_dir: Path, steps: int = 12) -> None:
    """A user's loop with Guard and telemetry off: no z-scores, MFU or memory are logged."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = parse_config({"telemetry": {"enabled": False}, "train": {"log_every": 4}})
    guard = Guard(run_dir, model=model, optimizer=opt, config=cfg, max_steps=steps, progress=False)
    x = torch.randn(32, 8)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        guard.after_backward(loss, tokens=32)
        opt.step()
        opt.zero_grad()
        guard.end_step()
    guard.close()


def record_alert(
    db: Path, labels: dict[str, str], fired: float, resolved: float | None, summary: str = ""
) -> None:
    """Record one alert instance firing (and resolved) in a monitor state database, as the
    monitor's evaluation does."""
    alert = Alert(
        rule=f"lossguard/{labels['alertname']}",
        fingerprint=fingerprint(labels),
        labels=labels,
        annotations={"summary": summary},
        state=AlertState.FIRING,
        value=1.0,
        active_at=fired,
        fired_at=fired,
    )
    transitions = [Transition(TransitionKind.FIRING, fired, alert)]
    if resolved is not None:
        transitions.append(Transition(TransitionKind.RESOLVED, resolved, alert))
    state = AlertStore(db)
    try:
        state.record({}, transitions)
    finally:
        state.close()


def record_action(db: Path, run_id: str, request_id: str, at: float) -> None:
    """Record a rollback the monitor took for ``run_id``, applied."""
    state = AlertStore(db)
    try:
        ActionStore(state).add(
            ActionRecord(
                id=request_id,
                run_id=run_id,
                kind="rollback",
                alertname="LossNonFinite",
                fingerprint="f" * 16,
                labels={"alertname": "LossNonFinite", "run_id": run_id},
                origin="rules",
                args={"target": "last_good", "skip_batches": "abandoned", "lr_scale": 0.5},
                state="applied",
                created_at=at,
                updated_at=at,
                attempt=1,
                of_attempts=3,
                result={
                    "from_step": 16,
                    "to_step": 10,
                    "checkpoint": "step_00000010",
                    "skipped_batches": 6,
                    "lr_scale": 0.5,
                },
            )
        )
    finally:
        state.close()


def test_jsonl_skips_and_counts_lines_that_are_not_objects(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"a": 1}\n\n[1, 2]\n{"b": NaN}\n\xff\xfe\n{"c": "torn')
    lines = read_jsonl(path)
    assert [list(r) for r in lines.records] == [["a"], ["b"]]
    assert lines.unreadable == 3
    assert read_jsonl(tmp_path / "missing.jsonl").records == ()


def test_own_loop_without_telemetry_says_what_it_lacks(tmp_path: Path) -> None:
    run_dir = tmp_path / "own"
    own_loop_run(run_dir)
    run = read_run(run_dir)
    assert run.outcome == "completed" and run.run_id == run_dir.name
    assert [p.step for p in run.train] == [4, 8, 12]
    assert all("mfu" not in p.values and "loss_zscore" not in p.values for p in run.train)
    assert run.train[-1].values["tokens"] == 12 * 32
    files = write_report(run_dir)
    assert files.html == run_dir / "report.html" and files.png == run_dir / "report.png"
    ids = svg_ids(files.html)
    assert {"series-train_loss", "series-grad_norm", "series-tokens_per_second"} <= ids
    # each missing series is said in words, not left as an empty axis
    assert {"note-no-zscore", "note-no-mfu", "no-data-memory"} <= ids
    assert "series-mfu" not in ids and "mark-rollback-0" not in ids


def test_crashed_run_with_a_torn_last_line(tmp_path: Path, corpus_cache: Path) -> None:
    settings = tiny_settings(
        tmp_path / "runs",
        corpus_cache,
        train={"max_steps": 100, "log_every": 2, "eval_every": 100},
        checkpoint={"every": 5, "async": False},
        faults=[{"kind": "crash", "step": 12}],
    )
    agent = start_agent(write_config(tmp_path / "crash.yaml", settings))
    _, err = agent.communicate(timeout=120)
    assert agent.returncode == 70, err
    run_dir = tmp_path / "runs" / "tiny"
    with open(run_dir / "metrics.jsonl", "a") as log:  # a write the crash cut short
        log.write('{"kind": "train", "step": 12, "train_lo')
    run = read_run(run_dir)
    assert run.outcome.startswith("crashed") and run.agent is not None
    assert run.unreadable == {"metrics.jsonl": 1}
    assert [p.step for p in run.train] == [2, 4, 6, 8, 10]
    assert [c.step for c in run.checkpoints] == [5, 10]
    assert run.last_step == 10

    out = tmp_path / "report"
    # a subprocess: the CLI sets up logging on the stderr it is given
    done = monitor_cli("report", str(run_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(out / "report.html"), str(out / "report.png")]
    refused = monitor_cli("report", str(run_dir), "--out", str(out / "report.png" / "x"))
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"lossguard-monitor: error: cannot write the report into {out / 'report.png' / 'x'}: "
        "Not a directory"
    ]
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "crashed (no exit recorded, its process is gone)" in page
    assert "1 line not JSON, skipped" in page
    assert {"series-train_loss", "mark-checkpoints", "mark-last-good"} <= svg_ids(
        out / "report.html"
    )


def test_a_folder_that_is_no_run_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for folder, why in (("empty", "not a run directory"), ("missing", "no such directory")):
        with pytest.raises(ReportError, match=why):
            read_run(tmp_path / folder)
    done = monitor_cli("report", str(tmp_path / "empty"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"lossguard-monitor: error: {tmp_path / 'empty'}: not a run directory "
        "(none of metrics.jsonl, events.jsonl, agent.json in it)"
    ]
    assert not (tmp_path / "empty" / "report.html").exists()


def test_alerts_and_actions_come_from_the_monitor_state(tmp_path: Path) -> None:
    run_dir = tmp_path / "own"
    own_loop_run(run_dir)
    first, second, last = [p.time for p in read_run(run_dir).train if p.time is not None]
    db = tmp_path / "state.db"
    critical = {"alertname": "LossNonFinite", "run_id": "own", "severity": "critical"}
    record_alert(db, critical, fired=first, resolved=second, summary="loss is NaN")
    record_alert(db, {**critical, "run_id": "another"}, fired=first, resolved=None)
    warning = {"alertname": "LowMFU", "run_id": "own", "severity": "warning"}
    record_alert(db, warning, fired=second, resolved=None)
    record_action(db, "own", "lg-0123-1", at=first)

    run = read_run(run_dir, db)
    assert [(a.name, a.resolved_at) for a in run.alerts] == [
        ("LossNonFinite", second),
        ("LowMFU", None),
    ]
    assert run.step_at(first) == 4 and run.step_at(second) == 8 and run.step_at(last + 60) == 12
    assert [a.id for a in run.actions] == ["lg-0123-1"]
    files = write_report(run_dir, tmp_path / "out", state_db=db)
    ids = svg_ids(files.html)
    assert {"mark-alert-0", "mark-alert-1"} <= ids and "mark-alert-2" not in ids
    page = files.html.read_text(encoding="utf-8")
    assert "still firing" in page and "loss is NaN" in page and "lg-0123-1" in page
    # the action in the monitor's words (its console's, notifications', read API's), not JSON
    actions = re.search(r'<section id="actions">(.*?)</section>', page, re.S)
    assert actions is not None and "{" not in actions.group(1)
    assert (
        "<td>4</td><td>rollback</td><td>LossNonFinite</td><td>applied</td><td>rolled back from "
        "step 16 to step 10 (step_00000010), skipped 6 batches, lr scaled by 0.5 (run&#x27;s lr "
        "scale now 0.5), attempt 1 of 3</td><td>lg-0123-1</td>"
    ) in actions.group(1)

    with pytest.raises(ReportError, match="--state: no state database at"):
        read_run(run_dir, tmp_path / "nowhere.db")
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    with pytest.raises(ReportError, match=r"junk\.db: file is not a database"):
        read_run(run_dir, junk)
    other = tmp_path / "other.db"  # some other SQLite database: refused, and left as it was
    with contextlib.closing(sqlite3.connect(other)) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    with pytest.raises(ReportError, match=r"other\.db is not a lossguard monitor state database"):
        read_run(run_dir, other)
    with contextlib.closing(sqlite3.connect(other)) as conn:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("notes",)]


def test_a_diverged_branch_does_not_flatten_the_recovered_loss(tmp_path: Path) -> None:
    """The loss panel's y range is the recovered timeline's; the abandoned divergence runs off
    the top as a faint branch, and the rollback's mark names the state it restored."""
    kept = [Point(s, None, {"train_loss": 3.0 - s / 100}) for s in range(1, 101)]
    diverged = [Point(s, None, {"train_loss": 10.0**s}, abandoned=True) for s in range(81, 95)]
    restore = marks.Restore("rollback", 94, 80, "memory/step_00000080", None)
    run = RunRecord(
        tmp_path, "r", "completed", None, (*kept[:80], *diverged, *kept[80:]), (), (), (),
        (restore,), (), (), (),
    )  # fmt: skip
    ax = Figure().add_subplot()
    draw_loss(ax, run)
    low, high = ax.get_ylim()
    assert ax.get_yscale() == "linear" and 1.8 < low < 2.0 and 3.0 < high < 3.2
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "mark-rollback-0-label"]
    assert labels == [" rollback to step 80 (memory/step_00000080)"]


def test_text_from_the_run_is_drawn_as_written_not_as_math(tmp_path: Path) -> None:
    """A ``$`` in a request id (any client may choose one) is a dollar sign in the figures."""
    run_dir = tmp_path / "own"
    own_loop_run(run_dir)
    step = read_run(run_dir).train[-1].step
    odd = ["cost$5", r"$\undefinedmacro{x}$", "$$"]
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as out:
        for request_id in odd:
            event = {"event": "command", "cmd": "pause", "id": request_id, "ok": True}
            out.write(json.dumps({**event, "step": step, "time": 0.0}) + "\n")
    files = write_report(run_dir, tmp_path / "out")
    page = files.html.read_text(encoding="utf-8")
    assert "cost$5" in page and "undefinedmacro" in page
