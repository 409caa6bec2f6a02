"""Aggregation operators over an instant vector: sum, min, max, avg, count (by / without)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lossguard.monitor.promql.model import METRIC_NAME, Labels, Sample


@dataclass
class _Group:
    value: float
    mean: float
    count: int = 1

    def add(self, op: str, value: float) -> None:
        if op == "sum":
            self.value += value
        elif op == "max":
            if self.value < value or math.isnan(self.value):
                self.value = value
        elif op == "min":
            if self.value > value or math.isnan(self.value):
                self.value = value
        elif op == "count":
            self.count += 1
        elif op == "avg":
            self.count += 1
            if math.isinf(self.mean) and (
                (math.isinf(value) and (self.mean > 0) == (value > 0))
                or not (math.isinf(value) or math.isnan(value))
            ):
                return
            # Divide each side of the "-" by the count to avoid overflows (as Prometheus does).
            self.mean += value / self.count - self.mean / self.count

    def result(self, op: str) -> float:
        return {"avg": self.mean, "count": float(self.count)}.get(op, self.value)


def group_labels(labels: Labels, grouping: Sequence[str], without: bool) -> Labels:
    """The output label set of a series: ``by`` keeps the grouping labels, ``without`` drops
    them and the metric name."""
    if without:
        return tuple(p for p in labels if p[0] not in grouping and p[0] != METRIC_NAME)
    return tuple(p for p in labels if p[0] in grouping)


def aggregate(
    op: str, vector: Sequence[Sample], grouping: Sequence[str], without: bool
) -> list[Sample]:
    """One sample per group, in order of first appearance; values accumulate in input order."""
    groups: dict[Labels, _Group] = {}
    for sample in vector:
        key = group_labels(sample.labels, grouping, without)
        group = groups.get(key)
        if group is None:
            groups[key] = _Group(sample.value, sample.value)
        else:
            group.add(op, sample.value)
    return [Sample(labels, group.result(op)) for labels, group in groups.items()]
