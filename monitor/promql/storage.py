"""What the evaluator reads: the ``Storage`` protocol, staleness markers, an in-memory store."""

from __future__ import annotations

import bisect
import math
import struct
import threading
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from lossguard.monitor.promql.matchers import Matcher
from lossguard.monitor.promql.model import METRIC_NAME, Labels, make_labels

_STALE_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", _STALE_BITS))[0]
"""Prometheus's staleness marker: a NaN with a special bit pattern that ends a series."""


def is_stale(value: float) -> bool:
    """Whether ``value`` is the staleness marker (not just any NaN)."""
    return math.isnan(value) and struct.unpack("<Q", struct.pack("<d", value))[0] == _STALE_BITS


class Storage(Protocol):
    """A source of raw samples."""

    def select(
        self, matchers: list[Matcher], start: float, end: float, *, latest: bool = False
    ) -> Iterable[tuple[Labels, list[tuple[float, float]]]]:
        """Series matching all ``matchers`` with their samples ``(t_seconds, value)`` in
        ``[start, end]``, sorted by time; staleness markers included as :data:`STALE_NAN`.
        With ``latest``, only the last sample of each series in the window."""
        ...


def _doubles() -> array[float]:
    return array("d")


@dataclass
class _Series:
    """One series' samples as C doubles: 16 bytes a sample."""

    labels: dict[str, str]
    times: array[float] = field(default_factory=_doubles)
    values: array[float] = field(default_factory=_doubles)


class MemoryStorage:
    """Samples in memory, per series sorted by time; a sample at an existing time replaces it.

    Series are indexed by metric name, so a selector naming its metric scans only that name's
    series. Safe to share between threads: one ingesting, others selecting.
    """

    def __init__(self) -> None:
        self._series: dict[Labels, _Series] = {}
        self._by_name: dict[str, dict[Labels, _Series]] = {}
        self._oldest = math.inf  # no sample is older than this
        self._lock = threading.Lock()

    def add(self, labels: Labels | Mapping[str, str], t: float, value: float) -> None:
        key = make_labels(labels)
        with self._lock:
            self._put(key, t, value)

    def add_many(self, samples: Iterable[tuple[Labels, float]], t: float) -> None:
        """Add samples that share the time ``t``; their labels must already be normalised
        (as :func:`make_labels` returns them)."""
        with self._lock:
            for key, value in samples:
                self._put(key, t, value)

    def mark_stale(self, labels: Labels | Mapping[str, str], t: float) -> None:
        """End the series at ``t`` (as Prometheus does when a target stops exposing it)."""
        self.add(labels, t, STALE_NAN)

    def truncate(self, before: float) -> None:
        """Forget samples older than ``before``, and series left without samples."""
        with self._lock:
            if before <= self._oldest:
                return
            oldest = math.inf
            for key, series in list(self._series.items()):
                cut = bisect.bisect_left(series.times, before)
                del series.times[:cut], series.values[:cut]
                if series.times:
                    oldest = min(oldest, series.times[0])
                else:
                    self._forget(key)
            self._oldest = oldest

    def select(
        self, matchers: list[Matcher], start: float, end: float, *, latest: bool = False
    ) -> Iterator[tuple[Labels, list[tuple[float, float]]]]:
        found = []
        with self._lock:
            for key, series in self._candidates(matchers).items():
                if all(m.matches(series.labels.get(m.name, "")) for m in matchers):
                    hi = bisect.bisect_right(series.times, end)
                    lo = max(hi - 1, 0) if latest else bisect.bisect_left(series.times, start)
                    if lo < hi and series.times[lo] >= start:
                        samples = list(zip(series.times[lo:hi], series.values[lo:hi], strict=True))
                        found.append((key, samples))
        return iter(found)

    def _put(self, key: Labels, t: float, value: float) -> None:
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(dict(key))
            self._by_name.setdefault(series.labels.get(METRIC_NAME, ""), {})[key] = series
        times = series.times
        if not times or t > times[-1]:
            times.append(t)
            series.values.append(value)
        else:
            index = bisect.bisect_left(times, t)
            if times[index] == t:
                series.values[index] = value
            else:
                times.insert(index, t)
                series.values.insert(index, value)
        if t < self._oldest:
            self._oldest = t

    def _forget(self, key: Labels) -> None:
        series = self._series.pop(key)
        name = series.labels.get(METRIC_NAME, "")
        same_name = self._by_name[name]
        del same_name[key]
        if not same_name:
            del self._by_name[name]

    def _candidates(self, matchers: list[Matcher]) -> dict[Labels, _Series]:
        """The series worth testing: one name's, when a matcher fixes the name."""
        for matcher in matchers:
            if matcher.name == METRIC_NAME and matcher.op == "=":
                return self._by_name.get(matcher.value, {})
        return self._series
