"""What the evaluator reads: the ``Storage`` protocol, staleness markers, an in-memory store."""

from __future__ import annotations

import bisect
import math
import struct
import threading
from array import array
from collections.abc import Iterable, Mapping
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
        self, matchers: list[Matcher], start_ms: float, end_ms: float, *, latest: bool = False
    ) -> Iterable[tuple[Labels, list[tuple[int, float]]]]:
        """Series matching all ``matchers``, in label order, with their samples
        ``(t_ms, value)`` in ``[start_ms, end_ms]`` (milliseconds), sorted by time; staleness
        markers included as :data:`STALE_NAN`. With ``latest``, only the last sample of each
        series in the window."""
        ...


def _milliseconds(t: float) -> int:
    """A time in seconds as Prometheus's integer milliseconds."""
    return round(t * 1000)


class Series:
    """One stored series: its label set and its samples as C numbers (integer milliseconds
    and doubles: 16 bytes a sample).
    A writer may keep the handle across scrapes; :meth:`MemoryStorage.append` revives a
    series that :meth:`MemoryStorage.truncate` forgot meanwhile."""

    __slots__ = ("key", "stored", "times", "values")

    def __init__(self, key: Labels) -> None:
        self.key = key
        self.times = array("q")
        self.values = array("d")
        self.stored = True  # False once truncate forgot it

    def label(self, name: str) -> str:
        """The value of label ``name`` ("" when absent)."""
        for key, value in self.key:
            if key == name:
                return value
        return ""


class MemoryStorage:
    """Samples in memory, per series sorted by time; a sample at an existing time replaces it.

    Each label set is stored once, as one :class:`Series` whose label names, values and pairs
    are interned (shared by every series that has them); a scrape of an unchanged label set
    only appends to its series. Series are indexed by metric name, so a selector naming its
    metric scans only that name's series. Safe to share between threads: one ingesting, others
    selecting.
    """

    def __init__(self) -> None:
        self._series: dict[Labels, Series] = {}
        self._by_name: dict[str, dict[Labels, Series]] = {}
        self._sorted: dict[str, list[Series]] = {}  # a name's series in label order, as selected
        self._pairs: dict[tuple[str, str], tuple[str, str]] = {}
        self._oldest = math.inf  # no sample is older than this
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._series)

    def add(self, labels: Labels | Mapping[str, str], t: float, value: float) -> None:
        """Add one sample at ``t`` (seconds)."""
        key = make_labels(labels)
        with self._lock:
            self._put(self._get(key), _milliseconds(t), value)

    def add_many(self, samples: Iterable[tuple[Labels, float]], t: float) -> None:
        """Add samples that share the time ``t`` (seconds); their labels must already be
        normalised (as :func:`make_labels` returns them)."""
        ms = _milliseconds(t)
        with self._lock:
            for key, value in samples:
                self._put(self._get(key), ms, value)

    def series(self, key: Labels) -> Series:
        """The handle of the series ``key`` (normalised labels), created empty if new."""
        with self._lock:
            return self._get(key)

    def append(self, samples: Iterable[tuple[Series, float]], t: float) -> None:
        """Add samples at the time ``t`` (seconds) to series by handle."""
        ms = _milliseconds(t)
        with self._lock:
            for series, value in samples:
                if not series.stored:
                    series = self._get(series.key)
                times = series.times
                if times and times[-1] >= ms:
                    self._put(series, ms, value)
                else:
                    times.append(ms)
                    series.values.append(value)
            if ms < self._oldest:
                self._oldest = ms

    def mark_stale(self, labels: Labels | Mapping[str, str], t: float) -> None:
        """End the series at ``t`` (as Prometheus does when a target stops exposing it)."""
        self.add(labels, t, STALE_NAN)

    def truncate(self, before: float) -> None:
        """Forget samples older than ``before`` (seconds), and series left without samples."""
        before = _milliseconds(before)
        with self._lock:
            if before <= self._oldest:
                return
            oldest = math.inf
            forgotten = False
            for series in list(self._series.values()):
                cut = bisect.bisect_left(series.times, before)
                del series.times[:cut], series.values[:cut]
                if series.times:
                    oldest = min(oldest, series.times[0])
                else:
                    self._forget(series)
                    forgotten = True
            self._oldest = oldest
            if forgotten:  # the interned pairs of the series left
                self._pairs = {pair: pair for key in self._series for pair in key}

    def select(
        self, matchers: list[Matcher], start_ms: float, end_ms: float, *, latest: bool = False
    ) -> list[tuple[Labels, list[tuple[int, float]]]]:
        found = []
        with self._lock:
            candidates, rest = self._candidates(matchers)
            for series in candidates:
                if rest and not _matches(series, rest):
                    continue
                times = series.times
                count = len(times)
                hi = count if count and times[-1] <= end_ms else bisect.bisect_right(times, end_ms)
                if latest:
                    if hi and times[hi - 1] >= start_ms:
                        found.append((series.key, [(times[hi - 1], series.values[hi - 1])]))
                    continue
                lo = bisect.bisect_left(times, start_ms)
                if lo < hi:
                    samples = list(zip(times[lo:hi], series.values[lo:hi], strict=True))
                    found.append((series.key, samples))
        return found

    def _get(self, key: Labels) -> Series:
        series = self._series.get(key)
        if series is None:
            pairs = self._pairs
            key = tuple([pairs.setdefault(pair, pair) for pair in key])
            series = self._series[key] = Series(key)
            name = series.label(METRIC_NAME)
            self._by_name.setdefault(name, {})[key] = series
            self._sorted.pop(name, None)
        return series

    def _put(self, series: Series, t: int, value: float) -> None:
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

    def _forget(self, series: Series) -> None:
        series.stored = False
        del self._series[series.key]
        name = series.label(METRIC_NAME)
        self._sorted.pop(name, None)
        same_name = self._by_name[name]
        del same_name[series.key]
        if not same_name:
            del self._by_name[name]

    def _candidates(self, matchers: list[Matcher]) -> tuple[list[Series], list[Matcher]]:
        """The series worth testing in label order (one name's, when a matcher fixes the
        name) and the matchers left to test them with."""
        for index, matcher in enumerate(matchers):
            if matcher.name == METRIC_NAME and matcher.op == "=":
                rest = matchers[:index] + matchers[index + 1 :]
                ordered = self._sorted.get(matcher.value)
                if ordered is None:
                    same_name = self._by_name.get(matcher.value, {})
                    ordered = self._sorted[matcher.value] = _in_order(same_name)
                return ordered, rest
        return _in_order(self._series), matchers


def _in_order(series: dict[Labels, Series]) -> list[Series]:
    return [series[key] for key in sorted(series)]


def _matches(series: Series, matchers: list[Matcher]) -> bool:
    return all(matcher.matches(series.label(matcher.name)) for matcher in matchers)
