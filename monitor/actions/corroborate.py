"""Whether an alert from Alertmanager's webhook may start an action: the deployment's rules,
not the payload, say what is done, and the monitor's own view of the run must show it.

An incoming alert acts only if its ``alertname`` is a rule the monitor loaded, that rule's
``action`` label is the one the alert carries, the alert's run is one the monitor knows, and the
rule's expression, evaluated now on the monitor's own source (its scrape or its Prometheus),
returns a series of that run. A forged alert, sent straight to the webhook or through an open
Alertmanager, fails one of these and is refused with the reason.

Prometheus and Alertmanager may see a value before the monitor's own source does (its next
scrape or evaluation): an alert that passes the rules but that the monitor's view does not show
yet is held (:class:`AwaitingConfirmation`), looked at again each evaluation, and refused only
if the view still does not show it ``confirm_window_s`` after it came."""

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

CONFIRM_WITHIN_S = 15.0
"""The least time an alert the monitor's own view does not show yet waits for it before it is
refused: several of the monitor's scrape and evaluation intervals (1 s each by default)."""
VIEW_UPDATES = 3
"""How many updates of the monitor's view a held alert waits for, where they take longer."""


def confirm_window_s(view_update_s: float) -> float:
    """How long a held alert waits for the monitor's view, which takes up to ``view_update_s``
    to show a new value (a scrape and an evaluation): ``CONFIRM_WITHIN_S``, or
    ``VIEW_UPDATES`` updates where they take longer (a 15 s scrape and evaluation: 90 s)."""
    return max(CONFIRM_WITHIN_S, VIEW_UPDATES * view_update_s)


class Corroborator:
    """Judges incoming action alerts against the loaded rules and the monitor's own source."""

    def __init__(
        self,
        rules: Callable[[], Sequence[AlertingRule]],
        known_run: Callable[[str], bool],
        query: Query,
        *,
        confirm_within_s: float = CONFIRM_WITHIN_S,
    ) -> None:
        """``confirm_within_s``: how long an alert the view does not show yet is held for it
        (``confirm_window_s``)."""
        self._rules = rules
        self._known_run = known_run
        self._query = query
        self.confirm_within_s = confirm_within_s

    def rule_refusal(self, alert: ActionAlert) -> str | None:
        """Why ``alert`` may never act, whatever the monitor sees later: no such rule or
        action, no run or one the monitor does not know (one line); None: it may."""
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
        return None

    def unconfirmed(self, alert: ActionAlert, now: float) -> str | None:
        """Why the monitor's own view does not show ``alert`` now (one line); None: it does."""
        action = alert.labels.get(ACTION_LABEL, "")
        rules = [
            rule
            for rule in self._rules()
            if rule.name == alert.name and dict(rule.labels).get(ACTION_LABEL) == action
        ]
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


class AwaitingConfirmation:
    """Alerts that passed the rules but that the monitor's own view did not show when they
    came: each is looked at again (``review``) until the view shows it or it has waited the
    corroborator's ``confirm_within_s``. Keyed by request id: a repeat of a held alert changes
    nothing."""

    def __init__(self, corroborator: Corroborator) -> None:
        self._corroborator = corroborator
        self._held: dict[str, tuple[ActionAlert, float]] = {}  # request id -> (alert, until)

    def hold(self, alert: ActionAlert, now: float, *, limit: int) -> bool:
        """Hold ``alert`` (a repeat changes nothing); False: ``limit`` alerts are held already
        (a flood), and this one is not."""
        if alert.request_id not in self._held and len(self._held) >= limit:
            return False
        until = now + self._corroborator.confirm_within_s
        self._held.setdefault(alert.request_id, (alert, until))
        return True

    def drop(self, request_id: str) -> None:
        """Alertmanager resolved it: nothing to confirm any more."""
        self._held.pop(request_id, None)

    def review(self, now: float) -> tuple[list[ActionAlert], list[tuple[ActionAlert, str]]]:
        """The held alerts the view shows now (released), and those that waited too long, with
        why they are refused (released too); the others stay held."""
        confirmed: list[ActionAlert] = []
        refused: list[tuple[ActionAlert, str]] = []
        for request_id, (alert, until) in list(self._held.items()):
            reason = self._corroborator.unconfirmed(alert, now)
            if reason is None:
                confirmed.append(alert)
            elif now >= until:
                refused.append((alert, reason))
            else:
                continue
            del self._held[request_id]
        return confirmed, refused
