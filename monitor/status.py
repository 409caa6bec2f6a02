"""``lossguard-monitor status``: the state database (firing alerts, silences, outbox, dead
letters) and, when the daemon answers, its targets."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

import requests

from lossguard.monitor.actions.store import ActionStore
from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.silences import SilenceStore
from lossguard.monitor.notify.store import DEAD, PENDING, NotifyStore, OutboxEntry
from lossguard.monitor.rules.alerting import AlertState
from lossguard.monitor.views import action_json, active_alerts

LISTED = 20  # pending notifications and dead letters shown


def collect(state: AlertStore, timeout_s: float = 2.0) -> dict[str, Any]:
    """Everything the status shows, as plain data (also the ``--json`` output)."""
    now = time.time()
    notify = NotifyStore(state)
    firing = [a for a in active_alerts(state) if a["state"] == AlertState.FIRING.value]
    actions = ActionStore(state)
    silences = [
        {
            "id": s.id,
            "matchers": [str(m) for m in s.matchers],
            "state": s.state(now),
            "starts_at": s.starts_at,
            "ends_at": s.ends_at,
            "created_by": s.created_by,
            "comment": s.comment,
        }
        for s in SilenceStore(state).all()
        if s.state(now) != "expired"
    ]
    url = state.get_meta("listen_url")
    daemon: dict[str, Any] = {"url": url, "reachable": False}
    if url:
        try:
            reply = requests.get(f"{url}/api/status", timeout=timeout_s)
            reply.raise_for_status()
            daemon.update(reply.json(), reachable=True)
        except (requests.RequestException, ValueError) as exc:
            daemon["error"] = type(exc).__name__
    return {
        "monitor": daemon,
        "firing": firing,
        "silences": silences,
        "actions": [
            action_json(r)
            for r in actions.open() + [r for r in actions.recent(LISTED) if not r.is_open]
        ],
        "outbox": notify.counts(),
        "pending": [_entry(e) for e in notify.entries(PENDING, LISTED)],
        "dead_letters": [_entry(e) for e in notify.entries(DEAD, LISTED)],
    }


def _entry(entry: OutboxEntry) -> dict[str, Any]:
    n = entry.notification
    return {
        "id": entry.id,
        "lane": entry.lane,
        "status": n.status,
        "alerts": [a.name for a in n.alerts],
        "group": n.group_key,
        "attempts": entry.attempts,
        "created_at": entry.created_at,
        "next_attempt": entry.next_attempt,
        "last_error": entry.last_error,
    }


def render(report: dict[str, Any], now: float | None = None) -> str:
    """The report as text for a terminal."""
    now = time.time() if now is None else now
    lines: list[str] = []
    daemon = report["monitor"]
    if daemon["reachable"]:
        last = daemon.get("last_evaluation")
        ago = f"last evaluation {_ago(now, last)}" if last else "no evaluation yet"
        lines.append(f"monitor  {daemon['url']}  running, {daemon.get('rules')} rules, {ago}")
        targets = daemon.get("targets", [])
        lines.append(f"targets ({len(targets)})")
        for t in targets:
            up = {True: "UP", False: "DOWN", None: "NEW"}[t["up"]]
            why = f"  {t['last_error']}" if t.get("last_error") else ""
            run = f"  run {t['run_id']}" if t.get("run_id") else ""
            rank = f" rank {t['rank']}" if run and t.get("rank") else ""
            lines.append(f"  {up:<5} {t['url']}{run}{rank}{why}")
    else:
        where = daemon["url"] or "unknown address"
        lines.append(f"monitor  {where}  not reachable (targets unknown)")
    lines.append(f"firing alerts ({len(report['firing'])})")
    for a in report["firing"]:
        labels = a["labels"]
        rest = " ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "alertname")
        lines.append(f"  {labels.get('alertname', '')}  {rest}  since {_ago(now, a['since'])}")
    lines.append(f"silences ({len(report['silences'])})")
    for s in report["silences"]:
        until = f"ends in {_duration(s['ends_at'] - now)}"
        lines.append(
            f"  {s['id']}  {' '.join(s['matchers'])}  {s['state']}, {until}"
            f"  by {s['created_by']}: {s['comment']}"
        )
    open_actions = [a for a in report["actions"] if a["state"] in ("held", "pending")]
    lines.append(
        f"actions ({len(open_actions)} pending, {len(report['actions']) - len(open_actions)} "
        "recent)"
    )
    for a in report["actions"]:
        lines.append(
            f"  {a['state'].upper():<8} {a['kind']:<10} run {a['run_id']}  {a['alertname']}"
            f"  {_ago(now, a['created_at'])}: {a['text']}"
        )
    counts = report["outbox"]
    lines.append(
        f"outbox: {counts[PENDING]} pending, {counts['delivered']} delivered, {counts[DEAD]} dead"
    )
    for e in report["pending"]:
        why = f", last error: {e['last_error']}" if e["last_error"] else ""
        lines.append(
            f"  #{e['id']}  {e['lane']}  {e['status']} {','.join(e['alerts'])}"
            f"  attempts {e['attempts']}{why}"
        )
    lines.append(f"dead letters ({counts[DEAD]})")
    for e in report["dead_letters"]:
        lines.append(
            f"  #{e['id']}  {e['lane']}  {e['status']} {','.join(e['alerts'])}"
            f"  {_ago(now, e['created_at'])}: {e['last_error']}"
        )
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=True, default=asdict)


def _ago(now: float, then: float | None) -> str:
    return "?" if then is None else f"{_duration(now - then)} ago"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
