"""The report page: one self-contained HTML file (inline CSS and SVG; no script, no external
resource of any kind), readable offline."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

from lossguard.common import __version__
from lossguard.monitor.actions.describe import describe
from lossguard.monitor.report.data import RunRecord
from lossguard.monitor.report.figures import PANELS, panel_svg

AUDIT_ROWS = 2000
"""The newest audit records shown; the page says how many older ones it leaves out."""
DETAIL_CHARS = 200
_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1180px;
       color: #222; background: #fff; }
h1 { font-size: 22px; margin: 0 0 8px; }
h2 { font-size: 17px; margin: 28px 0 6px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; width: 100%; }
th, td { border-bottom: 1px solid #eee; padding: 3px 6px; text-align: left;
         vertical-align: top; }
th { background: #f4f4f4; }
td:first-child { white-space: nowrap; }
.facts td:first-child { color: #555; width: 14em; }
.outcome-completed, .outcome-stopped, .outcome-running { color: #1a7f37; }
.outcome-bad { color: #a50f15; font-weight: 600; }
figure { margin: 0; }
svg { max-width: 100%; height: auto; }
footer { margin-top: 32px; color: #777; font-size: 12px; }
"""


def render(run: RunRecord) -> str:
    """The report of ``run`` as one HTML document."""
    sections = [_summary(run)]
    for panel in PANELS:
        sections.append(
            f'<section id="panel-{panel.key}"><h2>{escape(panel.title)}</h2>'
            f"<figure>{panel_svg(panel, run)}</figure></section>"
        )
    if run.state_db is not None:
        sections.append(_alerts(run))
        sections.append(_actions(run))
    sections.append(_audit(run))
    title = f"lossguard run {run.run_id}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{escape(title)}</h1>{''.join(sections)}"
        f"<footer>Written by lossguard-monitor report (lossguard {escape(__version__)}) at "
        f"{_when(time.time())} from {escape(str(run.run_dir))}.</footer></body></html>\n"
    )


def _summary(run: RunRecord) -> str:
    agent = run.agent
    last = run.train[-1].values if run.train else {}
    vals = [v for p in run.evals if (v := p.values.get("val_loss")) is not None]
    on_disk = [c for c in run.checkpoints if c.on_disk]
    good = next((c.name for c in run.checkpoints if c.last_good), "none")
    ok = run.outcome in ("completed", "stopped", "running")
    facts: list[tuple[str, str]] = [
        (
            "outcome",
            f'<span class="{"outcome-" + run.outcome if ok else "outcome-bad"}">'
            f"{escape(run.outcome)}</span>",
        ),
        ("run directory", escape(str(run.run_dir))),
        ("started", _when(agent.started_at) if agent and agent.started_at else "unknown"),
        ("finished", _when(agent.finished_at) if agent and agent.finished_at else "not recorded"),
        ("last step", _text(run.last_step)),
        ("tokens", _text(last.get("tokens"), "{:,.0f}")),
        ("last train loss", _text(last.get("train_loss"), "{:.4f}")),
        ("best val loss", _text(min(vals, default=None), "{:.4f}")),
        (
            "spikes / non-finite",
            f"{sum(not s.nonfinite for s in run.spikes)} / {sum(s.nonfinite for s in run.spikes)}",
        ),
        (
            "rollbacks / resumes",
            f"{sum(r.kind == 'rollback' for r in run.restores)} / "
            f"{sum(r.kind == 'resume' for r in run.restores)}",
        ),
        (
            "checkpoints",
            f"{len(run.checkpoints)} saved, {len(on_disk)} on disk, last good: {escape(good)}",
        ),
        ("control commands", str(len(run.commands))),
        (
            "monitor alerts",
            f"{len(run.alerts)} (from {escape(str(run.state_db))})"
            if run.state_db
            else "no monitor state database given (--state)",
        ),
    ]
    for name, count in run.unreadable.items():
        facts.append((name, f"{count} line{'s' * (count != 1)} not JSON, skipped"))
    rows = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in facts)
    return f'<section id="summary"><table class="facts">{rows}</table></section>'


def _alerts(run: RunRecord) -> str:
    rows = [
        (
            a.name,
            a.severity,
            _when(a.fired_at),
            str(run.step_at(a.fired_at)),
            "still firing" if a.resolved_at is None else _when(a.resolved_at),
            "" if a.resolved_at is None else str(run.step_at(a.resolved_at)),
            a.summary,
        )
        for a in run.alerts
    ]
    headers = ("alert", "severity", "firing", "step", "resolved", "step", "summary")
    return _table("alerts", "Monitor alerts", headers, rows, "No alert fired for this run.")


def _actions(run: RunRecord) -> str:
    """Each action in the words the monitor's console, notifications and read API use."""
    rows = [
        (
            _when(a.created_at),
            str(run.step_at(a.created_at)),
            a.kind,
            a.alertname,
            a.state.replace("_", " "),
            describe(a),
            a.id,
        )
        for a in run.actions
    ]
    headers = ("created", "step", "action", "alert", "state", "what happened", "request id")
    return _table("actions", "Monitor actions", headers, rows, "The monitor took no action.")


def _audit(run: RunRecord) -> str:
    events = run.events[-AUDIT_ROWS:]
    rows = [
        (
            _when(e["time"]) if isinstance(e.get("time"), int | float) else "",
            _text(e.get("step")),
            str(e.get("event", "")),
            str(e.get("source", "agent")),
            _detail({k: v for k, v in e.items() if k not in ("time", "step", "event", "source")}),
        )
        for e in events
    ]
    left_out = len(run.events) - len(events)
    note = f"<p>The {left_out} oldest records are left out.</p>" if left_out else ""
    headers = ("time", "step", "event", "source", "details")
    empty = "events.jsonl holds no record."
    return _table("audit", "Audit trail (events.jsonl)", headers, rows, empty, note)


def _table(
    key: str,
    title: str,
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    empty: str,
    note: str = "",
) -> str:
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows
    )
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    content = f"<table><tr>{head}</tr>{body}</table>" if body else f"<p>{escape(empty)}</p>"
    return f'<section id="{key}"><h2>{escape(title)}</h2>{note}{content}</section>'


def _detail(fields: dict[str, Any]) -> str:
    """``key=value`` pairs, a diagnosis as its causes, each value cut to a readable length."""
    parts = []
    for key, value in fields.items():
        if value in (None, "", {}, []):
            continue
        if key == "diagnosis" and isinstance(value, dict) and value.get("causes"):
            value = "; ".join(str(c) for c in value["causes"])
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > DETAIL_CHARS:
            text = text[: DETAIL_CHARS - 1] + "…"
        parts.append(f"{key}={text}")
    return ", ".join(parts)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _text(value: float | None, form: str = "{}") -> str:
    return "unknown" if value is None else form.format(value)
