"""The alert lifecycle, as Prometheus's rules/alerting.go has it.

Each evaluation of a rule's expression yields one alert per result sample: its labels are the
sample's (without ``__name__``) plus the rule's labels plus ``alertname``. A new alert is
*pending*; it *fires* once it has been active for the rule's ``for``; when it leaves the result
it is *resolved* (a pending one just goes *inactive*), unless ``keep_firing_for`` holds a firing
one a while longer. Every change of state is a :class:`Transition` carrying a stable fingerprint
of the alert's labels.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from lossguard.monitor.promql import METRIC_NAME, Sample, Value
from lossguard.monitor.rules.rulefile import AlertingRule, RuleGroup
from lossguard.monitor.rules.templating import TemplateQuery, expand

ALERT_NAME = "alertname"


class AlertState(str, Enum):
    PENDING = "pending"
    FIRING = "firing"


class TransitionKind(str, Enum):
    PENDING = "pending"  # inactive -> pending
    FIRING = "firing"  # pending -> firing
    RESOLVED = "resolved"  # firing -> gone
    INACTIVE = "inactive"  # pending -> gone, never fired


@dataclass
class Alert:
    """One active alert of a rule."""

    rule: str
    fingerprint: str
    labels: dict[str, str]
    annotations: dict[str, str]
    state: AlertState
    value: float
    active_at: float
    fired_at: float | None = None
    keep_firing_since: float | None = None


@dataclass(frozen=True)
class Transition:
    """A change of an alert's state at ``at``, with the alert as it was then."""

    kind: TransitionKind
    at: float
    alert: Alert


class EvaluationFailed(Exception):
    """A rule whose result cannot become alerts (one line)."""


def fingerprint(labels: Mapping[str, str]) -> str:
    """A stable identity for a label set: the same labels always give the same 16 hex digits."""
    digest = hashlib.sha256()
    for name in sorted(labels):
        digest.update(name.encode() + b"\xff" + labels[name].encode() + b"\xff")
    return digest.hexdigest()[:16]


def rule_keys(groups: list[RuleGroup]) -> list[tuple[str, RuleGroup, AlertingRule]]:
    """Each rule with a key that survives reloads and restarts: ``group/alert`` (``#n`` for a
    repeated alert name within a group)."""
    keyed: list[tuple[str, RuleGroup, AlertingRule]] = []
    for group in groups:
        seen: dict[str, int] = {}
        for rule in group.rules:
            seen[rule.name] = seen.get(rule.name, 0) + 1
            suffix = f"#{seen[rule.name]}" if seen[rule.name] > 1 else ""
            keyed.append((f"{group.key}/{rule.name}{suffix}", group, rule))
    return keyed


@dataclass
class RuleAlerts:
    """The active alerts of one rule, and its health."""

    key: str
    rule: AlertingRule
    group: RuleGroup
    alerts: dict[str, Alert] = field(default_factory=dict)
    last_error: str | None = None
    last_evaluation: float | None = None

    def evaluate(
        self,
        result: Value,
        t: float,
        *,
        external_labels: Mapping[str, str] | None = None,
        external_url: str = "",
        hold_missing: bool = False,
        query: TemplateQuery | None = None,
    ) -> list[Transition]:
        """Apply one evaluation's result at ``t``; the alerts' changes of state, in order.
        With ``hold_missing``, alerts absent from the result stay as they are (the source does
        not yet have the history to say they ended, as after a monitor restart). ``query``
        runs the templates' ``query`` calls at ``t``.

        Raises :class:`EvaluationFailed` (and changes nothing) when the result cannot be turned
        into alerts: two samples with the same labels once the rule's are applied, or more
        alerts than the group's ``limit``."""
        samples = [Sample((), result)] if isinstance(result, float) else result
        found: dict[str, Alert] = {}
        for sample in samples:
            alert = self._alert(sample, t, external_labels or {}, external_url, query)
            if alert.fingerprint in found:
                raise EvaluationFailed(
                    "vector contains metrics with the same labelset after applying alert labels"
                )
            found[alert.fingerprint] = alert
        staying = len(found) + sum(
            1
            for fp, alert in self.alerts.items()
            if fp not in found and (self._held(alert, hold_missing) or self._kept(alert, t))
        )
        if self.group.limit and staying > self.group.limit:
            raise EvaluationFailed(f"exceeded limit of {self.group.limit} with {staying} alerts")
        transitions: list[Transition] = []
        for fp, new in found.items():
            old = self.alerts.get(fp)
            if old is None:
                self.alerts[fp] = new
                transitions.append(Transition(TransitionKind.PENDING, t, copy.deepcopy(new)))
            else:
                old.value, old.annotations, old.labels = new.value, new.annotations, new.labels
                old.keep_firing_since = None
        for fp, alert in list(self.alerts.items()):
            if fp not in found and self._held(alert, hold_missing):
                continue
            if fp not in found and not self._keeps_firing(alert, t):
                del self.alerts[fp]
                kind = (
                    TransitionKind.RESOLVED
                    if alert.state is AlertState.FIRING
                    else TransitionKind.INACTIVE
                )
                transitions.append(Transition(kind, t, alert))
            elif alert.state is AlertState.PENDING and t - alert.active_at >= self.rule.for_s:
                alert.state, alert.fired_at = AlertState.FIRING, t
                transitions.append(Transition(TransitionKind.FIRING, t, copy.deepcopy(alert)))
        self.last_error, self.last_evaluation = None, t
        return transitions

    def fail(self, error: str, t: float) -> None:
        """Record an evaluation that failed: the alerts stay as they were (as in Prometheus)."""
        self.last_error, self.last_evaluation = error, t

    def firing(self) -> list[Alert]:
        return [a for a in self.alerts.values() if a.state is AlertState.FIRING]

    @staticmethod
    def _held(alert: Alert, hold_missing: bool) -> bool:
        """A firing alert outlives a result that cannot yet say it ended; a pending one does
        not (its ``for`` must be observed)."""
        return hold_missing and alert.state is AlertState.FIRING

    def _kept(self, alert: Alert, t: float) -> bool:
        """Whether ``keep_firing_for`` would keep a missing alert firing at ``t``."""
        if alert.state is not AlertState.FIRING or self.rule.keep_firing_for_s <= 0:
            return False
        since = t if alert.keep_firing_since is None else alert.keep_firing_since
        return t - since < self.rule.keep_firing_for_s

    def _keeps_firing(self, alert: Alert, t: float) -> bool:
        if alert.state is not AlertState.FIRING or self.rule.keep_firing_for_s <= 0:
            return False
        if alert.keep_firing_since is None:
            alert.keep_firing_since = t
        return t - alert.keep_firing_since < self.rule.keep_firing_for_s

    def _alert(
        self,
        sample: Sample,
        t: float,
        external_labels: Mapping[str, str],
        external_url: str,
        query: TemplateQuery | None,
    ) -> Alert:
        series = dict(sample.labels)

        def render(text: str) -> str:
            return expand(
                text,
                labels=series,
                value=sample.value,
                external_labels=external_labels,
                external_url=external_url,
                query=query,
            )

        labels = {k: v for k, v in series.items() if k != METRIC_NAME}
        labels.update((name, render(text)) for name, text in self.rule.labels)
        labels[ALERT_NAME] = self.rule.name
        labels = {k: v for k, v in sorted(labels.items()) if v != ""}
        return Alert(
            rule=self.key,
            fingerprint=fingerprint(labels),
            labels=labels,
            annotations={name: render(text) for name, text in self.rule.annotations},
            state=AlertState.PENDING,
            value=sample.value,
            active_at=t,
        )
