"""The loaded rules with their alerts: evaluated together at one time, replaced on reload with
the alerts of unchanged rules carried over."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping

from lossguard.monitor.promql import PromQLError, Value
from lossguard.monitor.rules.alerting import (
    Alert,
    AlertState,
    EvaluationFailed,
    RuleAlerts,
    Transition,
    TransitionKind,
    rule_keys,
)
from lossguard.monitor.rules.rulefile import AlertingRule, RuleGroup, reach_s
from lossguard.monitor.rules.templating import QueryError, QuerySample, TemplateQuery
from lossguard.monitor.sources import SourceError

log = logging.getLogger("lossguard.monitor.rules")

Query = Callable[[AlertingRule, float], Value]
"""Evaluates a rule's expression at a time (the embedded evaluator, or a Prometheus server)."""

ExprQuery = Callable[[str, float], Value]
"""Evaluates PromQL text at a time: what templates' ``query`` calls run on."""


def template_query(run: ExprQuery, t: float) -> TemplateQuery:
    """Templates' ``query`` at ``t``, as Prometheus's EngineQueryFunc: a scalar is one sample
    without labels; a failed query is a :class:`QueryError`."""

    def query(expr: str) -> list[QuerySample]:
        try:
            value = run(expr, t)
        except (PromQLError, SourceError) as exc:
            raise QueryError(str(exc)) from None
        if isinstance(value, float):
            return [QuerySample({}, value)]
        return [QuerySample(dict(s.labels), s.value) for s in value]

    return query


class RuleSet:
    """Every rule of the loaded groups, each with its active alerts."""

    def __init__(
        self,
        groups: list[RuleGroup],
        *,
        external_labels: Mapping[str, str] | None = None,
        external_url: str = "",
        alerts: Mapping[str, Iterable[Alert]] | None = None,
    ) -> None:
        self.groups = groups
        self.external_labels = dict(external_labels or {})
        self.external_url = external_url
        self.rules = [RuleAlerts(key, rule, group) for key, group, rule in rule_keys(groups)]
        for entry in self.rules:
            for alert in (alerts or {}).get(entry.key, ()):
                entry.alerts[alert.fingerprint] = alert

    def evaluate(
        self,
        query: Query,
        t: float,
        *,
        groups: set[str] | None = None,
        observe: Callable[[float], None] | None = None,
        history_start: float = -math.inf,
        expr_query: ExprQuery | None = None,
    ) -> list[Transition]:
        """Evaluate every rule (of ``groups`` when given) at ``t``; all transitions, in rule
        order. A rule that fails keeps its alerts and records why (``last_error``). A rule
        whose ranges reach back before ``history_start`` resolves none of its alerts.
        ``expr_query`` answers the templates' ``query`` calls."""
        transitions: list[Transition] = []
        templates = None if expr_query is None else template_query(expr_query, t)
        for entry in self.rules:
            if groups is not None and entry.group.key not in groups:
                continue
            started = time.perf_counter()
            try:
                result = query(entry.rule, t)
                transitions.extend(
                    entry.evaluate(
                        result,
                        t,
                        external_labels=self.external_labels,
                        external_url=self.external_url,
                        hold_missing=t - reach_s(entry.rule) < history_start,
                        query=templates,
                    )
                )
            except (PromQLError, SourceError, EvaluationFailed) as exc:
                entry.fail(str(exc), t)
            except Exception as exc:  # a bug in one rule must not stop the others
                log.exception("rule %s: unexpected error", entry.rule.name)
                entry.fail(f"internal error: {type(exc).__name__}: {exc}", t)
            if observe is not None:
                observe(time.perf_counter() - started)
        return transitions

    def replace(self, groups: list[RuleGroup], t: float) -> tuple[RuleSet, list[Transition]]:
        """The rule set for new ``groups``. A rule with the same key and labels keeps its alerts
        (as Prometheus carries state over a reload); the alerts of every other old rule end now:
        resolved, or inactive if still pending."""
        return RuleSet.restore(
            groups,
            self.active(),
            t,
            external_labels=self.external_labels,
            external_url=self.external_url,
            labels={entry.key: entry.rule.labels for entry in self.rules},
        )

    @classmethod
    def restore(
        cls,
        groups: list[RuleGroup],
        alerts: Mapping[str, Iterable[Alert]],
        t: float,
        *,
        external_labels: Mapping[str, str] | None = None,
        external_url: str = "",
        labels: Mapping[str, tuple[tuple[str, str], ...]] | None = None,
    ) -> tuple[RuleSet, list[Transition]]:
        """A rule set for ``groups`` that takes over the ``alerts`` of rules it still has (with
        the same ``labels``, when those are given); the others' alerts end at ``t``."""
        current = {key: rule.labels for key, _, rule in rule_keys(groups)}
        kept = {
            key: list(found)
            for key, found in alerts.items()
            if key in current and (labels is None or labels.get(key) == current[key])
        }
        ended = [
            Transition(
                TransitionKind.RESOLVED
                if alert.state is AlertState.FIRING
                else TransitionKind.INACTIVE,
                t,
                alert,
            )
            for key, found in alerts.items()
            if key not in kept
            for alert in found
        ]
        new = cls(groups, external_labels=external_labels, external_url=external_url, alerts=kept)
        return new, ended

    def active(self) -> dict[str, list[Alert]]:
        """The active alerts by rule key (every rule present, possibly with none)."""
        return {entry.key: list(entry.alerts.values()) for entry in self.rules}


class Schedule:
    """When each group is next due: on multiples of its own ``interval`` (or the default)."""

    def __init__(self, default_interval_s: float) -> None:
        self.default_interval_s = default_interval_s
        self._next: dict[str, float] = {}

    def due(self, groups: Iterable[RuleGroup], now: float) -> set[str]:
        """The keys of the groups to evaluate at ``now``."""
        return {g.key for g in groups if self._next.get(g.key, -math.inf) <= now}

    def done(self, groups: Iterable[RuleGroup], names: set[str], t: float) -> None:
        """Groups ``names`` were evaluated at ``t``: each is next due one interval on."""
        for group in groups:
            if group.key in names:
                interval = group.interval_s or self.default_interval_s
                self._next[group.key] = (math.floor(t / interval) + 1) * interval

    def wake_time(self, now: float) -> float:
        """When the next group is due (a default interval from ``now`` before any ran)."""
        return min(self._next.values(), default=now + self.default_interval_s)

    def reset(self) -> None:
        """Everything is due now (after a reload)."""
        self._next.clear()
