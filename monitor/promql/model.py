"""The data model: label sets and samples."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

METRIC_NAME = "__name__"

Labels = tuple[tuple[str, str], ...]
"""A label set: (name, value) pairs sorted by name, no empty values, ``__name__`` included."""


def make_labels(pairs: Mapping[str, str] | Iterable[tuple[str, str]]) -> Labels:
    """Normalise to :data:`Labels` (sorted; an empty value means the label is absent)."""
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return tuple(sorted((name, value) for name, value in dict(items).items() if value != ""))


def label_value(labels: Labels, name: str) -> str:
    """The value of ``name``, or "" when absent."""
    for key, value in labels:
        if key == name:
            return value
    return ""


def drop_metric_name(labels: Labels) -> Labels:
    return tuple(pair for pair in labels if pair[0] != METRIC_NAME)


def format_labels(labels: Labels) -> str:
    """Prometheus notation: ``name{a="b", c="d"}`` (``{}`` for the empty set)."""
    name = label_value(labels, METRIC_NAME)
    rest = ", ".join(
        f"{key}={json.dumps(value, ensure_ascii=False)}"
        for key, value in labels
        if key != METRIC_NAME
    )
    return f"{name}{{{rest}}}" if rest or not name else name


@dataclass(frozen=True)
class Sample:
    """One element of an instant vector."""

    labels: Labels
    value: float
