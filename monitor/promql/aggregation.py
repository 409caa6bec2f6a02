"""Aggregation operators over an instant vector: sum, min, max, avg, count, topk and bottomk
(by / without), as Prometheus 2.42's engine computes them.

topk and bottomk keep each group's k samples whole (labels and metric name): in a heap of
Go's ``container/heap`` shape, whose top is the sample to drop next (NaN first), then sorted
by Go's insertion sort (``sort.Sort`` for at most 12 samples), so that the same input gives
the same samples in the same order as Prometheus; above 12 samples equal values may come out
in another order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lossguard.monitor.promql.errors import EvaluationError
from lossguard.monitor.promql.model import METRIC_NAME, Labels, Sample

_MAX_INT64 = 9223372036854774784.0  # the largest float64 that converts to an int64
_MIN_INT64 = -9223372036854775808.0


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
    op: str,
    vector: Sequence[Sample],
    grouping: Sequence[str],
    without: bool,
    param: float | None = None,
) -> list[Sample]:
    """One sample per group (topk, bottomk: up to ``param`` per group), groups in order of first
    appearance; values accumulate in input order."""
    if op in ("topk", "bottomk"):
        assert param is not None, "the parser gives topk and bottomk their k"
        return _select_k(op == "topk", vector, grouping, without, param)
    groups: dict[Labels, _Group] = {}
    for sample in vector:
        key = group_labels(sample.labels, grouping, without)
        group = groups.get(key)
        if group is None:
            groups[key] = _Group(sample.value, sample.value)
        else:
            group.add(op, sample.value)
    return [Sample(labels, group.result(op)) for labels, group in groups.items()]


def _select_k(
    top: bool, vector: Sequence[Sample], grouping: Sequence[str], without: bool, param: float
) -> list[Sample]:
    """topk (``top``) or bottomk: each group's k highest (lowest) samples, highest (lowest)
    first."""
    if not _MIN_INT64 <= param <= _MAX_INT64:
        raise EvaluationError(f"Scalar value {_go_float(param)} overflows int64")
    k = int(param)  # toward zero, as Go's int64()
    if k < 1:
        return []
    heaps: dict[Labels, _KHeap] = {}
    for sample in vector:
        key = group_labels(sample.labels, grouping, without)
        heap = heaps.get(key)
        if heap is None:
            heaps[key] = _KHeap(top, [sample])
        else:
            heap.offer(sample, k)
    return [sample for heap in heaps.values() for sample in heap.ordered()]


class _KHeap:
    """Prometheus's vectorByValueHeap (topk) or vectorByReverseValueHeap (bottomk): the sample
    to drop next on top."""

    def __init__(self, top: bool, items: list[Sample]) -> None:
        self.top = top
        self.items = items

    def less(self, i: int, j: int) -> bool:
        a, b = self.items[i].value, self.items[j].value
        if math.isnan(a):
            return True
        return a < b if self.top else a > b

    def swap(self, i: int, j: int) -> None:
        self.items[i], self.items[j] = self.items[j], self.items[i]

    def offer(self, sample: Sample, k: int) -> None:
        """The engine's step for one more sample of the group."""
        head = self.items[0].value
        better = head < sample.value if self.top else head > sample.value
        if len(self.items) < k or better or math.isnan(head):
            if len(self.items) == k:
                if k == 1:  # replaced in place
                    self.items[0] = sample
                    return
                self.pop()
            self.push(sample)

    def push(self, sample: Sample) -> None:  # container/heap.Push
        self.items.append(sample)
        self._up(len(self.items) - 1)

    def pop(self) -> None:  # container/heap.Pop, the popped sample dropped
        last = len(self.items) - 1
        self.swap(0, last)
        self._down(0, last)
        self.items.pop()

    def _up(self, j: int) -> None:
        while j > 0:
            parent = (j - 1) // 2
            if not self.less(j, parent):
                break
            self.swap(parent, j)
            j = parent

    def _down(self, i: int, n: int) -> None:
        while (left := 2 * i + 1) < n:
            j = left
            if left + 1 < n and self.less(left + 1, left):
                j = left + 1
            if not self.less(j, i):
                break
            self.swap(i, j)
            i = j

    def ordered(self) -> list[Sample]:
        """``sort.Sort(sort.Reverse(heap))``: Go's insertion sort, its choice up to 12 samples."""
        for i in range(1, len(self.items)):
            j = i
            while j > 0 and self.less(j - 1, j):  # the reversed order's Less(j, j-1)
                self.swap(j, j - 1)
                j -= 1
        return self.items


def _go_float(value: float) -> str:
    """Go's %v of a float64 beyond the int64 range (Python's repr agrees there)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)
