"""Alertmanager's routing tree: which routes an alert goes to, with which grouping and timers,
and the key of the group it joins.

Follows Alertmanager 0.25's dispatch/route.go (``NewRoute``, ``Match``, ``Key``), the group
labels of dispatch.go (``getGroupLabels``) and its config checks of a route. As there, a child
inherits every option it leaves unset, and ``group_by: []`` counts as unset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from lossguard.common.config import ConfigError, Duration
from lossguard.monitor.notify.config import RouteConfig
from lossguard.monitor.notify.matchers import Matcher, format_matchers, matches_all, parse_matchers
from lossguard.monitor.rules.rulefile import LABEL_NAME
from lossguard.monitor.rules.templating import go_quote

GROUP_BY_ALL = "..."


@dataclass(frozen=True)
class Route:
    """One node of the routing tree, with the options it inherits filled in.

    Siblings with the same matchers have the same ``key`` and so the same group keys, as in
    Alertmanager 0.25 (which tells their groups apart by route object and receiver); ``id`` is
    the ``Route.ID()`` that later Alertmanagers added for that.
    """

    key: str  # Route.Key(): the matchers of each route from the root down, "/"-joined
    id: str  # the key, then "/" and the position among its siblings (the root: the key)
    receiver: str
    matchers: tuple[Matcher, ...]  # sorted, as Alertmanager sorts them
    group_by: tuple[str, ...]
    group_by_all: bool  # group_by: ['...']
    group_wait_s: float
    group_interval_s: float
    repeat_interval_s: float
    continue_: bool
    routes: tuple[Route, ...]

    def match(self, labels: Mapping[str, str]) -> list[Route]:
        """The routes the alert goes to: depth first, a matching child stops its later siblings
        unless it has ``continue``, and a matching route without matching children is the
        route itself. Empty when this route does not match."""
        if not matches_all(self.matchers, labels):
            return []
        found: list[Route] = []
        for child in self.routes:
            matched = child.match(labels)
            found += matched
            if matched and not child.continue_:
                break
        return found or [self]

    def group_labels(self, labels: Mapping[str, str]) -> dict[str, str]:
        """The alert's labels named in ``group_by`` (all of them for ``...``); labels the alert
        does not have, or has empty (Alertmanager drops those on receipt), are left out."""
        return {
            name: value
            for name, value in labels.items()
            if value and (self.group_by_all or name in self.group_by)
        }

    def group_key(self, labels: Mapping[str, str]) -> str:
        """Alertmanager's group key: ``{}/{severity="page"}:{alertname="X"}``."""
        return f"{self.key}:{label_set_string(self.group_labels(labels))}"


def label_set_string(labels: Mapping[str, str]) -> str:
    """Prometheus's ``model.LabelSet.String()`` as Alertmanager 0.25 has it: ``name=%q`` items
    sorted as strings (so ``a0`` comes before ``a``), joined by ", " in braces."""
    return "{" + ", ".join(sorted(f"{k}={go_quote(v)}" for k, v in labels.items())) + "}"


# Alertmanager's DefaultRouteOpts: what the root inherits.
_DEFAULTS = Route(
    key="",
    id="",
    receiver="",
    matchers=(),
    group_by=(),
    group_by_all=False,
    group_wait_s=30.0,
    group_interval_s=300.0,
    repeat_interval_s=4 * 3600.0,
    continue_=False,
    routes=(),
)


def build_route(config: RouteConfig) -> Route:
    """The routing tree of a ``route:`` section (ConfigError naming the key of a problem)."""
    if not config.receiver:
        raise ConfigError("route.receiver: the root route needs a receiver")
    if config.continue_:
        raise ConfigError("route.continue: the root route cannot have continue")
    return _build(config, None, "route", 0)


def _build(config: RouteConfig, parent: Route | None, path: str, position: int) -> Route:
    inherited = parent or _DEFAULTS
    matchers = tuple(sorted(parse_matchers(config.matchers), key=Matcher.sort_key))
    key = format_matchers(matchers)
    if parent is not None:
        key = f"{parent.key}/{key}"
    group_by, group_by_all = _group_by(config.group_by, inherited, path)
    route = Route(
        key=key,
        id=key if parent is None else f"{key}/{position}",
        receiver=config.receiver or inherited.receiver,
        matchers=matchers,
        group_by=group_by,
        group_by_all=group_by_all,
        group_wait_s=_seconds(config, "group_wait", inherited, path),
        group_interval_s=_seconds(config, "group_interval", inherited, path),
        repeat_interval_s=_seconds(config, "repeat_interval", inherited, path),
        continue_=config.continue_,
        routes=(),
    )
    children = tuple(
        _build(child, route, f"{path}.routes.{i}", i) for i, child in enumerate(config.routes)
    )
    return dataclasses.replace(route, routes=children)


def _group_by(names: list[str] | None, inherited: Route, path: str) -> tuple[tuple[str, ...], bool]:
    if not names:
        return inherited.group_by, inherited.group_by_all
    labels = [name for name in names if name != GROUP_BY_ALL]
    if len(labels) < len(names):
        if labels:
            raise ConfigError(f"{path}.group_by: '...' cannot be combined with label names")
        return (), True
    for i, name in enumerate(labels):
        if not LABEL_NAME.fullmatch(name):
            raise ConfigError(f"{path}.group_by: invalid label name {name!r}")
        if name in labels[:i]:
            raise ConfigError(f"{path}.group_by: label {name!r} is listed twice")
    return tuple(labels), False


def _seconds(config: RouteConfig, name: str, inherited: Route, path: str) -> float:
    """A timer of the route, or its parent's; only group_wait may be zero (as Alertmanager)."""
    duration: Duration | None = getattr(config, name)
    if duration is None:
        return float(getattr(inherited, f"{name}_s"))
    value = duration.seconds
    if value == 0 and name != "group_wait":
        raise ConfigError(f"{path}.{name}: cannot be zero")
    return value
