"""The scrape's exposition parser against prometheus-client's: whatever the exposition, and
however its values change between scrapes, the series kept and their values are those of a
whole parse by prometheus-client, and a line nobody reads gets no stored series."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from lossguard.monitor.promql import MemoryStorage
from lossguard.monitor.sources.exposition import (
    ExpositionParser,
    sample_lines,
    with_target_labels,
)
from lossguard.monitor.sources.fetch import ScrapeError

TARGET = {"job": "j", "instance": "127.0.0.1:1"}
NAMES = ["a", "ab", "a_total", "abc", "b", "lossguard_step", "lossguard_step_target"]

names = st.sampled_from(NAMES)
label_sets = st.dictionaries(
    st.sampled_from(["x", "y", "job", "le"]),
    st.text(alphabet='ab "\\{}=,\n', max_size=4),
    max_size=2,
)
values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**20), 10**20).map(float),
)
lines = st.lists(st.tuples(names, label_sets, st.integers(0, 1)), min_size=1, max_size=8)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def render(shape: list[tuple[str, dict[str, str], int]], numbers: list[float]) -> str:
    """An exposition: one line per sample (labels or none), a comment before some."""
    out = []
    for (name, labels, comment), value in zip(shape, numbers, strict=True):
        if comment:
            out.append(f"# HELP {name} Some help.")
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{inner}}} {_number(value)}" if labels else f"{name} {_number(value)}")
    return "\n".join(out) + "\n"


def reference(text: str, keep: frozenset[str] | None) -> dict[tuple, float]:
    """What prometheus-client reads, with the target's labels, the first of duplicates."""
    kept: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if keep is None or sample.name in keep:
                key = with_target_labels(sample.name, sample.labels, TARGET)
                kept.setdefault(key, sample.value)
    return kept


def _same(got: dict[tuple, float], want: dict[tuple, float]) -> bool:
    return got.keys() == want.keys() and all(
        got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in want
    )


@settings(max_examples=150, deadline=None)
@given(
    shape=lines,
    scrapes=st.lists(st.lists(values, min_size=8, max_size=8), min_size=1, max_size=4),
    keep=st.one_of(st.none(), st.frozensets(names)),
)
def test_every_scrape_reads_what_prometheus_client_reads(shape, scrapes, keep) -> None:
    storage = MemoryStorage()
    parser = ExpositionParser(storage, TARGET, keep)
    for numbers in scrapes:
        text = render(shape, numbers[: len(shape)])
        want = reference(text, keep)
        total, kept = parser.parse(text)
        assert total == sum(len(f.samples) for f in text_string_to_metric_families(text))
        assert _same({series.key: value for series, value in kept.items()}, want)
    assert len(storage) == len(reference(render(shape, [0.0] * len(shape)), keep))


@given(keep=st.frozensets(st.text(alphabet="ab_:", min_size=1, max_size=4), max_size=5))
def test_the_name_pattern_finds_exactly_the_lines_of_the_names(keep) -> None:
    candidates = sorted({*keep, "a", "ab", "a_", "b:", "ba"})
    text = "".join(f'{name}{{x="1"}} 1\n{name} 2\n# {name} 3\n' for name in candidates)
    found = sample_lines(keep).findall("\n" + text)
    assert found == [
        line for name in candidates if name in keep for line in (f'{name}{{x="1"}} 1', f"{name} 2")
    ]


def test_steady_scrapes_reuse_their_series() -> None:
    storage = MemoryStorage()
    parser = ExpositionParser(storage, TARGET, frozenset({"a"}))
    _, first = parser.parse('# TYPE a gauge\na{x="1"} 1\nb 2\n')
    _, second = parser.parse('# TYPE a gauge\na{x="1"} 5\nb 3\n')
    assert list(first) == list(second) and len(storage) == 1
    assert list(second.values()) == [5.0]


@pytest.mark.parametrize(
    "later",
    [
        "a 1\nb 2\ngarbage\n",  # a line more, of a name nobody reads
        "a 1_0\nb 2\n",  # a value Prometheus does not read, on a kept line
        'a 1\nb{x="1"} 2\n',  # a line of a series nobody reads that changed
    ],
)
def test_a_changed_exposition_reads_as_prometheus_client_reads_it(later) -> None:
    parser = ExpositionParser(MemoryStorage(), TARGET, frozenset({"a"}))
    parser.parse("a 1\nb 2\n")
    try:
        total, kept = parser.parse(later)
    except ScrapeError as exc:
        assert str(exc).startswith("parse error")
        return
    want = reference(later, frozenset({"a"}))
    assert _same({series.key: value for series, value in kept.items()}, want) and total == 2
