"""One target's text expositions to stored samples, with Prometheus's label rules.

The first exposition, and any with a line not seen in the last one, is parsed whole by
prometheus-client's parser (its verdict on a bad exposition is the scrape's). After that a
line is looked up by its text up to the value (the metric name comes first, so this names the
series) and only the series kept get a sample; a line of a series nobody reads costs a lookup
and the value check, nothing stored.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from lossguard.monitor.promql import METRIC_NAME, Labels, make_labels
from lossguard.monitor.promql.storage import MemoryStorage, Series
from lossguard.monitor.sources.fetch import ScrapeError, one_line

EXPORTED_PREFIX = "exported_"
_UNSEEN = Series(())  # not a stored series: a head not seen in the last exposition


def with_target_labels(name: str, exposed: Mapping[str, str], target: Mapping[str, str]) -> Labels:
    """The stored label set of an exposed sample (``honor_labels: false``): target labels win,
    clashing exposed values move to ``exported_<name>`` (prefixed again while taken)."""
    merged = {**exposed, METRIC_NAME: name}
    clashes = sorted(
        ((label, merged[label]) for label in sorted(target) if merged.get(label)),
        key=lambda pair: len(pair[0]),
    )
    merged.update(target)
    for label, value in clashes:
        renamed = EXPORTED_PREFIX + label
        while merged.get(renamed):
            renamed = EXPORTED_PREFIX + renamed
        merged[renamed] = value
    return make_labels(merged)


class ExpositionParser:
    """Parses one target's expositions into samples of its series in ``storage``."""

    def __init__(
        self,
        storage: MemoryStorage,
        target_labels: Mapping[str, str],
        keep_names: frozenset[str] | None,
        owner: Mapping[str, str] | None = None,
    ) -> None:
        self.storage = storage
        self.target_labels = dict(target_labels)
        self.owner = dict(owner or {})  # run_id and rank: added to all series, and no other
        self.run_id: str | None = None  # the ``run_id`` and ``rank`` exposed, as last seen
        self.rank: str | None = None
        self.keep(keep_names)

    def keep(self, names: frozenset[str] | None) -> None:
        """From now on keep only the series named ``names`` (None: all)."""
        self.keep_names = names
        self._heads: dict[str, Series | None] = {}  # a sample line up to its value: its series
        self._comments: frozenset[str] = frozenset()

    def parse(self, text: str) -> tuple[int, dict[Series, float]]:
        """``(samples exposed, kept samples by series)``; ScrapeError if it does not parse."""
        heads, comments = self._heads, self._comments
        kept: dict[Series, float] = {}
        total = 0
        for line in text.split("\n"):
            if not line:
                continue
            if line[0] == "#":
                if line in comments:
                    continue
                return self._parse_fully(text)
            head, _, value = line.rpartition(" ")
            series = heads.get(head, _UNSEEN)
            if series is _UNSEEN or "_" in value:
                return self._parse_fully(text)
            try:
                number = float(value)
            except ValueError:
                return self._parse_fully(text)  # which names the problem
            total += 1
            if series is not None and series not in kept:  # a duplicate: the first one counts
                kept[series] = number
        return total, kept

    def _parse_fully(self, text: str) -> tuple[int, dict[Series, float]]:
        try:
            samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        except (ValueError, IndexError) as exc:
            raise ScrapeError(f"parse error: {one_line(str(exc)) or 'invalid line'}") from None
        lines = [line for line in text.split("\n") if line and line[0] != "#"]
        reusable = len(samples) == len(lines)
        heads: dict[str, Series | None] = {}
        kept: dict[Series, float] = {}
        for sample, line in zip(samples, lines if reusable else [""] * len(samples), strict=True):
            series = self._series(sample.name, sample.labels)
            if series is not None and series not in kept:
                kept[series] = float(sample.value)
            head, _, value = line.rpartition(" ")
            reusable = reusable and sample.timestamp is None and _same(sample.value, value)
            heads[head] = series
        if reusable:
            self._heads = heads
            self._comments = frozenset(line for line in text.split("\n") if line[:1] == "#")
        else:
            self._heads, self._comments = {}, frozenset()
        return len(samples), kept

    def _series(self, name: str, labels: Mapping[str, str]) -> Series | None:
        if any(labels.get(label) not in ("", None, value) for label, value in self.owner.items()):
            raise ScrapeError(
                f"{_run_rank({**self.owner, **labels})} answered, not {_run_rank(self.owner)}"
            )
        if labels.get("run_id"):
            self.run_id, self.rank = labels["run_id"], labels.get("rank")
        if self.keep_names is not None and name not in self.keep_names:
            return None
        key = with_target_labels(name, {**labels, **self.owner}, self.target_labels)
        return self.storage.series(key)


def _run_rank(labels: Mapping[str, str]) -> str:
    """ "run R rank N", for errors."""
    return f"run {labels['run_id']} rank {labels['rank']}"


def _same(number: float, text: str) -> bool:
    """Whether ``text`` reads as ``number`` (NaN as NaN)."""
    try:
        parsed = float(text)
    except ValueError:
        return False
    return parsed == number or (parsed != parsed and number != number)
