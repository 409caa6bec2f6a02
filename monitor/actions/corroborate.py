"""Whether an alert from Alertmanager's webhook may start an action: the deployment's rules,
not the payload, say what is done, and the monitor's own view of the run must show it.

An incoming alert acts only if its ``alertname`` is a rule the monitor loaded, that rule's
``action`` label is the one the alert carries, the alert's run is one the monitor knows, and the
rule's expression, evaluated now on the monitor's own source (its scrape or its Prometheus),
returns a series of that run. A forged alert, sent straight to the webhook or through an open
Alertmanager, fails one of these and is refused with the reason."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lossguard.monitor.actions.model import ActionAlert
from lossguard.monitor.actions.policy import ACTION_LABEL
from lossguard.monitor.notify.model import RUN_LABEL
from lossguard.monitor.promql import PromQLError, Value
from lossguard.monitor.promql.model import METRIC_NAME, Labels
from lossguard.monitor.rules.rulefile import AlertingRule
from lossguard.monitor.sources import SourceError

SCRAPER_LABELS = frozenset({METRIC_NAME, "job", "instance"})
"""Labels that say who scraped a series (Prometheus or the monitor), not which series it is."""

Query = Callable[[str, float], Value]


class Corroborator:
    """Judges incoming action alerts against the loaded rules and the monitor's own source."""

    def __init__(
        self,
        rules: Callable[[], Sequence[AlertingRule]],
        known_run: Callable[[str], bool],
        query: Query,
    ) -> None:
        self._rules = rules
        self._known_run = known_run
        self._query = query

    def refusal(self, alert: ActionAlert, now: float) -> str | None:
        """Why ``alert`` may not act (one line); None: the monitor's view confirms it."""
        action = alert.labels.get(ACTION_LABEL, "")
        named = [rule for rule in self._rules() if rule.name == alert.name]
        if not named:
            return f"alertname {alert.name!r} is not a rule the monitor loaded"
        rules = [rule for rule in named if dict(rule.labels).get(ACTION_LABEL) == action]
        if not rules:
            wanted = sorted({dict(r.labels).get(ACTION_LABEL) or "no action" for r in named})
            return f"rule {alert.name} asks for {', '.join(wanted)}, not action {action!r}"
        if not alert.run_id:
            return "the alert has no run_id label"
        if not self._known_run(alert.run_id):
            return f"run {alert.run_id!r} is not one the monitor knows"
        failures = []
        for rule in rules:
            try:
                value = self._query(rule.expr, now)
            except (SourceError, PromQLError) as exc:
                failures.append(str(exc))
                continue
            if isinstance(value, list) and any(_same_series(s.labels, alert) for s in value):
                return None
        why = f" (the query failed: {failures[0]})" if failures else ""
        return (
            f"not confirmed: the monitor's own view shows no {alert.name} for run "
            f"{alert.run_id!r} now{why}"
        )


def _same_series(labels: Labels, alert: ActionAlert) -> bool:
    """Whether a series of the rule's result is the one the alert is about: the same run, and
    every other label both have the same (who scraped it aside)."""
    if dict(labels).get(RUN_LABEL) != alert.run_id:
        return False
    return all(
        alert.labels.get(name, value) == value
        for name, value in labels
        if name not in SCRAPER_LABELS
    )
