"""Rule files in the Prometheus format: loaded, validated and checked as Prometheus does.

``groups`` -> ``name``, ``interval``, ``rules`` -> ``alert``, ``expr``, ``for``,
``keep_firing_for``, ``labels``, ``annotations``. Every expression is parsed by the embedded
evaluator, so one outside its PromQL subset is refused at load, by name. Recording rules are
refused too: the monitor only alerts. Errors are one line: ``FILE:LINE: what is wrong``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lossguard.common.config import parse_duration
from lossguard.monitor.promql import (
    LOOKBACK_MS,
    METRIC_NAME,
    Expr,
    PromQLError,
    UnsupportedError,
    parse,
)
from lossguard.monitor.promql.nodes import MatrixSelector, VectorSelector, walk
from lossguard.monitor.rules.templating import (
    QueryText,
    TemplateError,
    check_template,
    template_queries,
)

LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_GROUP_KEYS = {"name", "interval", "limit", "rules"}
_RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}


class RuleError(ValueError):
    """A rule file that cannot be used; ``str()`` is one line naming the file and the problem."""


@dataclass(frozen=True)
class AlertingRule:
    """One ``alert:`` rule, parsed and checked; ``query`` is None for an expression outside the
    embedded evaluator's subset, loaded for a Prometheus source. ``template_queries``: what its
    labels' and annotations' ``query`` calls run, parsed, None for one known only when it runs
    (or outside the subset, for a Prometheus source)."""

    name: str
    expr: str
    query: Expr | None = field(compare=False)
    for_s: float = 0.0
    keep_firing_for_s: float = 0.0
    labels: tuple[tuple[str, str], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    template_queries: tuple[Expr | None, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class RuleGroup:
    """A named group of rules evaluated together, at ``interval_s`` when it has its own."""

    name: str
    file: str
    rules: tuple[AlertingRule, ...]
    interval_s: float | None = None
    limit: int = 0

    @property
    def key(self) -> str:
        """``file.yml:group``: stable when the checkout moves (by file name, not path)."""
        return f"{Path(self.file).name}:{self.name}"


def load_rule_files(paths: Iterable[str | Path], *, full_promql: bool = False) -> list[RuleGroup]:
    """Every group of every file, checked; group names must be unique within a file. With
    ``full_promql`` (rules evaluated by Prometheus), expressions outside the embedded subset
    are accepted; syntax errors never are."""
    groups: list[RuleGroup] = []
    for path in paths:
        groups.extend(load_rule_file(path, full_promql=full_promql))
    return groups


def load_rule_file(path: str | Path, *, full_promql: bool = False) -> list[RuleGroup]:
    """The groups of one rule file; raises :class:`RuleError` on the first problem."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RuleError(f"{name}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise RuleError(f"{name}: not UTF-8 text (byte {exc.start})") from None
    return parse_rule_file(text, name, full_promql=full_promql)


def parse_rule_file(
    text: str, name: str = "<rules>", *, full_promql: bool = False
) -> list[RuleGroup]:
    """The groups in ``text`` (the file's contents; ``name`` is used in errors)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{mark.line + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RuleError(f"{name}:{where} invalid YAML: {problem}") from None
    if root is None:
        return []
    top = _mapping(root, name, "the file", {"groups"})
    groups_node = top.get("groups")
    if groups_node is None:
        return []
    groups: list[RuleGroup] = []
    seen: set[str] = set()
    for group_node in _sequence(groups_node, name, "groups"):
        group = _group(group_node, name, full_promql)
        if group.name in seen:
            raise RuleError(f'{name}:{_line(group_node)}: group name "{group.name}" is repeated')
        seen.add(group.name)
        groups.append(group)
    return groups


def longest_range_s(groups: Iterable[RuleGroup]) -> float:
    """How far back any rule looks: the longest range or offset plus the 5-minute lookback."""
    reach = max((reach_s(rule) for group in groups for rule in group.rules), default=0.0)
    return reach + LOOKBACK_MS / 1000


def reach_s(rule: AlertingRule) -> float:
    """The history a rule's ranges and offsets need, beyond the latest samples (its templates'
    queries included)."""
    queries = [q for q in (rule.query, *rule.template_queries) if q is not None]
    return max((_reach_ms(q) for q in queries), default=0) / 1000


def metric_names(groups: Iterable[RuleGroup]) -> frozenset[str] | None:
    """The metric names the rules and their templates' queries select, or None when a selector
    matches names by regex or a template's query is known only when it runs."""
    rules = [rule for group in groups for rule in group.rules]
    if any(q is None for rule in rules for q in rule.template_queries):
        return None
    selectors = [
        node
        for rule in rules
        for query in (rule.query, *rule.template_queries)
        if query is not None
        for node in walk(query)
        if isinstance(node, VectorSelector)
    ]
    if any(s.name is None for s in selectors):
        return None
    return frozenset(s.name for s in selectors if s.name is not None)


def _reach_ms(query: Expr) -> int:
    """The longest range plus offset (or offset alone) of the selectors in ``query``."""
    reach = 0
    for node in walk(query):
        if isinstance(node, MatrixSelector):
            reach = max(reach, node.range_ms + max(node.selector.offset_ms, 0))
        elif isinstance(node, VectorSelector):
            reach = max(reach, node.offset_ms)
    return reach


def _group(node: yaml.Node, file: str, full_promql: bool) -> RuleGroup:
    fields = _mapping(node, file, "a group", _GROUP_KEYS)
    group_name = _string(fields.get("name"), file, "group name", node)
    if not group_name:
        raise RuleError(f"{file}:{_line(node)}: group name must not be empty")
    where = f'group "{group_name}"'
    interval = fields.get("interval")
    interval_s = _duration(interval, file, f"{where}: interval") if interval else None
    if interval_s == 0:
        raise RuleError(f"{file}:{_line(interval)}: {where}: interval must be > 0")
    limit_node = fields.get("limit")
    limit = _integer(limit_node, file, f"{where}: limit") if limit_node is not None else 0
    rules_node = fields.get("rules")
    rules = [] if rules_node is None else _sequence(rules_node, file, f"{where}: rules")
    return RuleGroup(
        name=group_name,
        file=file,
        rules=tuple(_rule(rule, file, where, i + 1, full_promql) for i, rule in enumerate(rules)),
        interval_s=interval_s,
        limit=limit,
    )


def _rule(node: yaml.Node, file: str, group: str, index: int, full_promql: bool) -> AlertingRule:
    fields = _mapping(node, file, f"{group}: rule {index}", _RULE_KEYS)
    if "record" in fields:
        raise RuleError(
            f"{file}:{_line(node)}: {group}: rule {index}: recording rules are not supported "
            "by the monitor (it only alerts); evaluate them in Prometheus"
        )
    if "alert" not in fields:
        raise RuleError(f"{file}:{_line(node)}: {group}: rule {index}: 'alert' must be set")
    name = _string(fields["alert"], file, f"{group}: rule {index}: alert", node)
    where = f'{group}: rule {index} ("{name}")'
    if not name:
        raise RuleError(f"{file}:{_line(node)}: {where}: alert name must not be empty")
    if "expr" not in fields:
        raise RuleError(f"{file}:{_line(node)}: {where}: 'expr' must be set")
    expr_node = fields["expr"]
    expr = _string(expr_node, file, f"{where}: expr", node)
    query: Expr | None
    try:
        query = parse(expr)
    except UnsupportedError as exc:
        if not full_promql:
            raise RuleError(f"{file}:{_line(expr_node)}: {where}: expr: {exc}") from None
        query = None
    except PromQLError as exc:
        raise RuleError(f"{file}:{_line(expr_node)}: {where}: expr: {exc}") from None
    for_node, keep_node = fields.get("for"), fields.get("keep_firing_for")
    queries: list[Expr | None] = []
    return AlertingRule(
        name=name,
        expr=expr,
        query=query,
        for_s=_duration(for_node, file, f"{where}: for") if for_node else 0.0,
        keep_firing_for_s=(
            _duration(keep_node, file, f"{where}: keep_firing_for") if keep_node else 0.0
        ),
        labels=_templates(
            fields.get("labels"), file, f"{where}: labels", queries, full_promql, METRIC_NAME
        ),
        annotations=_templates(
            fields.get("annotations"), file, f"{where}: annotations", queries, full_promql
        ),
        template_queries=tuple(queries),
    )


def _templates(
    node: yaml.Node | None,
    file: str,
    where: str,
    queries: list[Expr | None],
    full_promql: bool,
    reserved: str | None = None,
) -> tuple[tuple[str, str], ...]:
    """The checked templates of ``node``; what their ``query`` calls run is added to
    ``queries``."""
    if node is None:
        return ()
    pairs: list[tuple[str, str]] = []
    for key, value in _mapping(node, file, where, None).items():
        if not LABEL_NAME.fullmatch(key) or key == reserved:
            raise RuleError(f"{file}:{_line(node)}: {where}: invalid name {key!r}")
        text = _string(value, file, f"{where}: {key}", node)
        try:
            check_template(text)
        except TemplateError as exc:
            raise RuleError(f"{file}:{_line(value)}: {where}: {key}: {exc}") from None
        for found in template_queries(text):
            try:
                queries.append(_template_query(found, full_promql))
            except PromQLError as exc:
                assert found is not None
                raise RuleError(
                    f"{file}:{_line(value)}: {where}: {key}: query {found.text!r}: {exc}"
                ) from None
        pairs.append((key, text))
    return tuple(sorted(pairs))


def _template_query(found: QueryText | None, full_promql: bool) -> Expr | None:
    """A template's query, parsed (a ``printf`` with its placeholders): None when it is known
    only as it runs or, for a Prometheus source, outside the subset. Raises PromQLError for
    one that is not valid PromQL, or outside the subset for the embedded evaluator."""
    if found is None:
        return None
    try:
        return parse(found.text)
    except UnsupportedError:
        if full_promql:
            return None
        raise


def _mapping(
    node: yaml.Node, file: str, where: str, allowed: set[str] | None
) -> dict[str, yaml.Node]:
    if not isinstance(node, yaml.MappingNode):
        raise RuleError(f"{file}:{_line(node)}: {where} must be a mapping")
    fields: dict[str, yaml.Node] = {}
    for key_node, value in node.value:
        key = str(key_node.value)
        if allowed is not None and key not in allowed:
            raise RuleError(f"{file}:{_line(key_node)}: {where}: unknown field {key!r}")
        if key in fields:
            raise RuleError(f"{file}:{_line(key_node)}: {where}: {key!r} is repeated")
        fields[key] = value
    return fields


def _sequence(node: yaml.Node, file: str, where: str) -> list[yaml.Node]:
    if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
        return []
    if not isinstance(node, yaml.SequenceNode):
        raise RuleError(f"{file}:{_line(node)}: {where} must be a list")
    return list(node.value)


def _string(node: yaml.Node | None, file: str, where: str, parent: yaml.Node) -> str:
    if node is None or not isinstance(node, yaml.ScalarNode) or node.tag.endswith(":null"):
        raise RuleError(f"{file}:{_line(node or parent)}: {where} must be a string")
    return str(node.value)


def _duration(node: yaml.Node, file: str, where: str) -> float:
    text = _string(node, file, where, node)
    try:
        return parse_duration(text) / 1000
    except ValueError:
        raise RuleError(
            f"{file}:{_line(node)}: {where}: not a valid duration: {text!r} (e.g. 30s, 5m, 1h30m)"
        ) from None


def _integer(node: yaml.Node, file: str, where: str) -> int:
    value = _scalar(node)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RuleError(f"{file}:{_line(node)}: {where} must be a whole number >= 0")
    return value


def _scalar(node: yaml.Node) -> Any:
    return yaml.SafeLoader(yaml.serialize(node)).get_single_data() if node is not None else None


def _line(node: yaml.Node | None) -> int:
    return node.start_mark.line + 1 if node is not None else 0
