"""What the evaluator reads: the ``Storage`` protocol, staleness markers, an in-memory store."""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from lossguard.monitor.promql.matchers import Matcher
from lossguard.monitor.promql.model import Labels, make_labels

_STALE_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", _STALE_BITS))[0]
"""Prometheus's staleness marker: a NaN with a special bit pattern that ends a series."""


def is_stale(value: float) -> bool:
    """Whether ``value`` is the staleness marker (not just any NaN)."""
    return math.isnan(value) and struct.unpack("<Q", struct.pack("<d", value))[0] == _STALE_BITS


class Storage(Protocol):
    """A source of raw samples."""

    def select(
        self, matchers: list[Matcher], start: float, end: float
    ) -> Iterable[tuple[Labels, list[tuple[float, float]]]]:
        """Series matching all ``matchers`` with their samples ``(t_seconds, value)`` in
        ``[start, end]``, sorted by time; staleness markers included as :data:`STALE_NAN`."""
        ...


@dataclass
class _Series:
    labels: dict[str, str]
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


class MemoryStorage:
    """Samples in memory, per series sorted by time; a sample at an existing time replaces it."""

    def __init__(self) -> None:
        self._series: dict[Labels, _Series] = {}

    def add(self, labels: Labels | Mapping[str, str], t: float, value: float) -> None:
        key = make_labels(labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(dict(key))
        if not series.times or t > series.times[-1]:
            series.times.append(t)
            series.values.append(value)
            return
        index = bisect.bisect_left(series.times, t)
        if series.times[index] == t:
            series.values[index] = value
        else:
            series.times.insert(index, t)
            series.values.insert(index, value)

    def mark_stale(self, labels: Labels | Mapping[str, str], t: float) -> None:
        """End the series at ``t`` (as Prometheus does when a target stops exposing it)."""
        self.add(labels, t, STALE_NAN)

    def truncate(self, before: float) -> None:
        """Forget samples older than ``before``, and series left without samples."""
        for key, series in list(self._series.items()):
            cut = bisect.bisect_left(series.times, before)
            del series.times[:cut], series.values[:cut]
            if not series.times:
                del self._series[key]

    def select(
        self, matchers: list[Matcher], start: float, end: float
    ) -> Iterator[tuple[Labels, list[tuple[float, float]]]]:
        for key, series in self._series.items():
            if all(m.matches(series.labels.get(m.name, "")) for m in matchers):
                lo = bisect.bisect_left(series.times, start)
                hi = bisect.bisect_right(series.times, end)
                if lo < hi:
                    yield key, list(zip(series.times[lo:hi], series.values[lo:hi], strict=True))
