"""Inhibition: while a source alert fires, matching target alerts are not sent.

Follows Alertmanager 0.25's inhibit/inhibit.go (``Mutes``, ``InhibitRule.inhibits``): a target
matching a rule's target matchers is inhibited by a firing alert that matches the source
matchers and has the same value of every ``equal`` label (absent counts as ""). When the target
matches the source matchers too, sources that also match the target matchers do not count, so
alerts of one kind never inhibit each other (nor an alert itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lossguard.common.config import ConfigError
from lossguard.monitor.notify.config import InhibitRuleConfig
from lossguard.monitor.notify.matchers import Matcher, matches_all, parse_matchers
from lossguard.monitor.rules.rulefile import LABEL_NAME


@dataclass(frozen=True)
class _Rule:
    source: tuple[Matcher, ...]
    target: tuple[Matcher, ...]
    equal: tuple[str, ...]

    def inhibits(self, labels: Mapping[str, str], firing: Sequence[Mapping[str, str]]) -> bool:
        if not matches_all(self.target, labels):
            return False
        two_sided = matches_all(self.source, labels)
        return any(
            matches_all(self.source, source)
            and all(source.get(n, "") == labels.get(n, "") for n in self.equal)
            and not (two_sided and matches_all(self.target, source))
            for source in firing
        )


class Inhibitor:
    """The inhibition rules of the config (ConfigError for a bad ``equal`` label name)."""

    def __init__(self, rules: Sequence[InhibitRuleConfig]) -> None:
        self.rules = [_rule(i, rule) for i, rule in enumerate(rules)]

    def inhibited(self, labels: Mapping[str, str], firing: Iterable[Mapping[str, str]]) -> bool:
        """Whether an alert with ``labels`` is inhibited while the ``firing`` alerts fire."""
        sources = list(firing)
        return any(rule.inhibits(labels, sources) for rule in self.rules)


def _rule(index: int, config: InhibitRuleConfig) -> _Rule:
    for name in config.equal:
        if not LABEL_NAME.fullmatch(name):
            raise ConfigError(f"inhibit_rules.{index}.equal: invalid label name {name!r}")
    return _Rule(
        source=tuple(parse_matchers(config.source_matchers)),
        target=tuple(parse_matchers(config.target_matchers)),
        equal=tuple(config.equal),
    )
