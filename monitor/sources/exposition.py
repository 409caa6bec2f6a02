"""One target's text expositions to stored samples, with Prometheus's label rules.

The first exposition, and any with a line of a kept series not seen in the last one, is parsed
whole by prometheus-client's parser (its verdict on a bad exposition is the scrape's). After
that only the lines of the metric names kept are looked at: the text format puts the name first
on each line, so one regular expression (a trie of the names, anchored at line starts) finds
them, and each is looked up by its text up to the value. Lines of series nobody reads are not
parsed again, and get no Python object, while the exposition keeps its number of lines (a
change parses it whole again).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from lossguard.monitor.promql import METRIC_NAME, Labels, make_labels
from lossguard.monitor.promql.storage import MemoryStorage, Series
from lossguard.monitor.sources.fetch import ScrapeError, printable_line

EXPORTED_PREFIX = "exported_"
_ANY_SAMPLE_LINE = re.compile(r"\n([^#\n][^\n]*)")
_UNSEEN = Series(())  # not a stored series: a line not seen in the last exposition


def _trie(words: Iterable[str]) -> str:
    """A regular expression matching exactly ``words``, as a trie (shared prefixes once)."""
    tree: dict[str, dict] = {}
    for word in words:
        node = tree
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def emit(node: dict[str, dict]) -> str:
        branches = [re.escape(char) + emit(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        group = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{group})?" if "" in node else group

    return emit(tree)


def sample_lines(names: frozenset[str] | None) -> re.Pattern[str]:
    """A pattern whose matches in ``"\\n" + text`` are the sample lines of the metrics
    ``names`` (None: of all metrics), each as its group 1."""
    if names is None:
        return _ANY_SAMPLE_LINE
    if not names:
        return re.compile(r"(?!)")
    return re.compile(r"\n((?:" + _trie(names) + r")[{ \t][^\n]*)")


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
        self._lines = sample_lines(names)
        self._heads: dict[str, Series | None] = {}  # sample line up to the value: its series
        self._newlines = -1  # of the exposition the heads come from (-1: parse whole)
        self._total = 0  # its samples

    def parse(self, text: str) -> tuple[int, dict[Series, float]]:
        """``(samples exposed, kept samples by series)``; ScrapeError if it does not parse."""
        if text.count("\n") != self._newlines:
            return self._parse_fully(text)
        heads = self._heads
        kept: dict[Series, float] = {}
        for line in self._lines.findall("\n" + text):
            head, _, value = line.rpartition(" ")
            series = heads.get(head, _UNSEEN)
            if series is _UNSEEN or "_" in value:
                return self._parse_fully(text)
            try:
                number = float(value)
            except ValueError:
                return self._parse_fully(text)  # which names the problem
            if series is not None and series not in kept:  # a duplicate: the first one counts
                kept[series] = number
        return self._total, kept

    def _parse_fully(self, text: str) -> tuple[int, dict[Series, float]]:
        self._newlines = -1
        try:
            samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        except (ValueError, IndexError) as exc:
            raise ScrapeError(
                f"parse error: {printable_line(str(exc)) or 'invalid line'}"
            ) from None
        lines = [line for line in text.split("\n") if line and line[0] != "#"]
        reusable = len(lines) == len(samples) and not any(line[0].isspace() for line in lines)
        heads: dict[str, Series | None] = {}
        kept: dict[Series, float] = {}
        for sample, line in zip(samples, lines if reusable else [""] * len(samples), strict=True):
            series = self._series(sample.name, sample.labels)
            if series is not None and series not in kept:  # a duplicate: the first one counts
                kept[series] = float(sample.value)
            head, _, value = line.rpartition(" ")
            reusable = reusable and sample.timestamp is None and _same(sample.value, value)
            heads[head] = series
        if reusable:  # the lines map one to one onto the samples: remember them
            self._heads, self._newlines, self._total = heads, text.count("\n"), len(samples)
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
