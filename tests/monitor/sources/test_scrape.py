"""The monitor's own scrapes: real exporters on 127.0.0.1, one cycle at a chosen time, then the
stored series read back through PromQL."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from lossguard.common.registry import AgentMetrics
from lossguard.monitor.promql import Matcher, Sample, make_labels
from lossguard.monitor.sources.scrape import ScrapeSource
from tests.support.processes import wait_for
from tests.support.promserver import ExpositionServer, exposition_server, free_port

T0 = 1_700_000_000.0


@pytest.fixture
def exporter() -> Iterator[ExpositionServer]:
    with exposition_server() as server:
        yield server


def source_for(*urls: str, **options) -> ScrapeSource:
    options.setdefault("retention_s", 600)
    options.setdefault("runs_root", None)
    return ScrapeSource(static_targets=list(urls), **options)


@pytest.fixture
def make_source() -> Iterator:
    made: list[ScrapeSource] = []

    def make(*urls: str, **options) -> ScrapeSource:
        made.append(source_for(*urls, **options))
        return made[-1]

    yield make
    for source in made:
        source.close()


def samples(source: ScrapeSource, expr: str, t: float) -> list[Sample]:
    value = source.query(expr, t)
    assert isinstance(value, list)
    return value


def value_of(source: ScrapeSource, expr: str, t: float) -> float:
    (sample,) = samples(source, expr, t)
    return sample.value


def labels_of(source: ScrapeSource, expr: str, t: float) -> dict[str, str]:
    (sample,) = samples(source, expr, t)
    return dict(sample.labels)


def test_agent_series_get_target_labels_and_report_series(exporter, make_source) -> None:
    metrics = AgentMetrics("run-a", 0, nvml=False)
    metrics.set("step", 5)
    metrics.inc("tokens", 1000)
    for seconds in (0.02, 0.2, 3.0):
        metrics.observe("step_duration_seconds", seconds)
    exporter.body = metrics.registry
    source = make_source(exporter.url)

    source.scrape_once(T0)
    metrics.inc("tokens", 500)
    source.scrape_once(T0 + 1)

    target = {"job": "lossguard-agent", "instance": exporter.instance}
    assert labels_of(source, "lossguard_step", T0 + 1) == {
        "__name__": "lossguard_step",
        "run_id": "run-a",
        "rank": "0",
        **target,
    }
    assert value_of(source, "lossguard_step", T0 + 1) == 5.0
    assert (
        value_of(source, "lossguard_tokens_total - lossguard_tokens_total offset 1s", T0 + 1) == 500
    )
    assert value_of(source, 'lossguard_step_duration_seconds_bucket{le="0.25"}', T0 + 1) == 2
    assert value_of(source, "lossguard_step_duration_seconds_count", T0 + 1) == 3
    assert value_of(source, "lossguard_step_duration_seconds_sum", T0 + 1) == pytest.approx(3.22)
    assert labels_of(source, "up", T0 + 1) == {"__name__": "up", **target}
    assert value_of(source, "up", T0 + 1) == 1.0
    exposed = sum(
        len(family.samples) for family in text_string_to_metric_families(exporter.render().decode())
    )
    assert value_of(source, "scrape_samples_scraped", T0 + 1) == exposed
    assert 0 < value_of(source, "scrape_duration_seconds", T0 + 1) < 1
    (status,) = source.targets()
    assert (status.url, status.instance, status.run_id) == (
        exporter.url,
        exporter.instance,
        "run-a",
    )
    assert (status.up, status.last_scrape, status.last_error) == (True, T0 + 1, None)


def test_samples_are_stored_at_the_scrape_time_in_milliseconds(exporter, make_source) -> None:
    exporter.body = "a 1\n"
    source = make_source(exporter.url)
    source.scrape_once(T0 + 0.0004)
    (series,) = source.storage.select([Matcher("__name__", "=", "a")], 0, math.inf)
    assert series == (
        make_labels({"__name__": "a", "job": "lossguard-agent", "instance": exporter.instance}),
        [(round(T0 * 1000), 1.0)],
    )


def test_clashing_exposed_labels_become_exported(exporter, make_source) -> None:
    exporter.body = 'x{job="theirs",instance="there",exported_job="taken"} 1\n'
    source = make_source(exporter.url, job="agents")
    source.scrape_once(T0)
    assert labels_of(source, "x", T0) == {
        "__name__": "x",
        "job": "agents",
        "instance": exporter.instance,
        "exported_instance": "there",
        "exported_job": "taken",
        "exported_exported_job": "theirs",
    }


def test_a_series_that_disappears_goes_stale(exporter, make_source) -> None:
    exporter.body = 'a 1\nb{k="v"} 2\n'
    source = make_source(exporter.url)
    source.scrape_once(T0)
    exporter.body = "a 3\n"
    source.scrape_once(T0 + 1)
    assert samples(source, "b", T0 + 1) == []
    assert value_of(source, "b", T0 + 0.5) == 2.0
    assert value_of(source, "a", T0 + 1) == 3.0
    exporter.body = 'a 4\nb{k="v"} 5\n'
    source.scrape_once(T0 + 2)
    assert value_of(source, "b", T0 + 2) == 5.0


def test_new_values_new_series_and_timestamps_are_all_read(exporter, make_source) -> None:
    source = make_source(exporter.url)
    for t, body, expected in [
        (T0, 'a{k="1 }"} 1\n', {"1 }": 1.0}),
        (T0 + 1, 'a{k="1 }"} 2e3\n', {"1 }": 2000.0}),  # same shape, new value
        (T0 + 2, 'a{k="1 }"} 3\na{k="2"} NaN\n', {"1 }": 3.0, "2": math.nan}),
        (T0 + 3, 'a{k="1 }"} 4 1000\n', {"1 }": 4.0}),  # the exposition's timestamp ignored
        (T0 + 4, 'a{k="1 }"} 5 2000\n', {"1 }": 5.0}),
        (T0 + 5, 'a{k="1 }"}\t6\n', {"1 }": 6.0}),
        (T0 + 6, 'a{k="1 }"} +Inf\n', {"1 }": math.inf}),
    ]:
        exporter.body = body
        source.scrape_once(t)
        found = {dict(s.labels)["k"]: s.value for s in samples(source, "a", t)}
        assert found.keys() == expected.keys(), body
        for key, value in expected.items():
            assert found[key] == value or (math.isnan(found[key]) and math.isnan(value)), body


def test_only_kept_names_are_stored(exporter, make_source) -> None:
    exporter.body = "a 1\nb 2\n"
    source = make_source(exporter.url, keep_names=frozenset({"a"}))
    source.scrape_once(T0)
    assert value_of(source, "a", T0) == 1.0
    assert samples(source, "b", T0) == []
    assert value_of(source, "up", T0) == 1.0
    assert value_of(source, "scrape_samples_scraped", T0) == 2


def test_kept_names_can_change_between_scrapes(exporter, make_source) -> None:
    exporter.body = "a 1\nb 2\n"
    source = make_source(exporter.url, keep_names=frozenset({"a"}))
    source.scrape_once(T0)
    source.keep_names = frozenset({"b"})  # as after a rules reload
    source.scrape_once(T0 + 1)
    assert samples(source, "a", T0 + 1) == []
    assert value_of(source, "b", T0 + 1) == 2.0


def refuse(server: ExpositionServer) -> str:
    server.close()
    return "connection refused"


def fail_with_500(server: ExpositionServer) -> str:
    server.status = 500
    return "HTTP 500 Internal Server Error"


def serve_garbage(server: ExpositionServer) -> str:
    server.body = "<html>\n<body>oops</body>\n</html>\n"
    return "parse error: invalid metric name:<html>"


def stall(server: ExpositionServer) -> str:
    server.stalled = True
    return "timed out after 0.3 s"


@pytest.mark.parametrize("failure", [refuse, fail_with_500, serve_garbage, stall])
def test_a_failed_scrape_is_up_0_and_ends_the_series(failure, exporter, make_source) -> None:
    exporter.body = "a 1\n"
    source = make_source(exporter.url, timeout_s=0.3)
    source.scrape_once(T0)
    reason = failure(exporter)
    source.scrape_once(T0 + 1)

    assert value_of(source, "up", T0 + 1) == 0.0
    assert value_of(source, "scrape_samples_scraped", T0 + 1) == 0.0
    assert samples(source, "a", T0 + 1) == []
    (status,) = source.targets()
    assert status.up is False and status.last_scrape == T0 + 1
    assert status.last_error == f"GET {exporter.url}: {reason}"


def test_history_is_cut_at_the_retention(exporter, make_source) -> None:
    exporter.body = "a 1\n"
    source = make_source(exporter.url, retention_s=10)
    for second in range(31):
        source.scrape_once(T0 + second)
    ((_, kept),) = source.storage.select([Matcher("__name__", "=", "a")], 0, math.inf)
    assert [t for t, _ in kept] == [round((T0 + second) * 1000) for second in range(20, 31)]


def test_a_bad_target_url_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'127.0.0.1:9410' is not an http\(s\) URL"):
        source_for("127.0.0.1:9410")


def write_agent_json(run_dir: Path, url: str, **extra: object) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {"run_id": run_dir.name, "metrics_urls": [url], "socket": None, "started_at": T0}
    (run_dir / "agent.json").write_text(json.dumps({**info, **extra}))


def test_discovered_targets_are_scraped_until_their_run_ends(exporter, tmp_path) -> None:
    exporter.body = 'a{run_id="r7"} 1\n'
    source = ScrapeSource(static_targets=[], runs_root=tmp_path, retention_s=600)
    try:
        source.scrape_once(T0)
        assert source.targets() == []
        write_agent_json(tmp_path / "r7", exporter.url)
        source.scrape_once(T0 + 1)
        (status,) = source.targets()
        assert (status.run_id, status.up) == ("r7", True)
        assert value_of(source, "up", T0 + 1) == 1.0

        write_agent_json(tmp_path / "r7", exporter.url, exit="completed", finished_at=T0 + 1.5)
        source.scrape_once(T0 + 2)
        assert source.targets() == []
        assert samples(source, "up", T0 + 2) == []
        assert samples(source, "a", T0 + 2) == []
        assert value_of(source, "a", T0 + 1.5) == 1.0
    finally:
        source.close()


@pytest.fixture
def discovering(tmp_path: Path) -> Iterator[ScrapeSource]:
    source = ScrapeSource(static_targets=[], runs_root=tmp_path, retention_s=600)
    yield source
    source.close()


def test_a_discovered_target_is_labelled_with_its_run_and_rank(
    exporter, make_source, tmp_path
) -> None:
    exporter.body = 'a{run_id="r7",rank="1"} 1\nprocess_start_time_seconds 5\n'
    with exposition_server('a{run_id="r7",rank="0"} 2\n') as other:
        write_agent_json(tmp_path / "r7", other.url, metrics_urls=[other.url, exporter.url])
        discovering = make_source(exporter.url, runs_root=tmp_path)  # also static: scraped once
        discovering.scrape_once(T0)

    rank_1 = {"job": "lossguard-agent", "instance": exporter.instance, "run_id": "r7", "rank": "1"}
    for name in ("up", "scrape_duration_seconds", "scrape_samples_scraped"):
        assert labels_of(discovering, f'{name}{{rank="1"}}', T0) == {"__name__": name, **rank_1}
    assert labels_of(discovering, 'a{rank="1"}', T0) == {"__name__": "a", **rank_1}
    assert labels_of(discovering, "process_start_time_seconds", T0) == {
        "__name__": "process_start_time_seconds",
        **rank_1,
    }
    assert value_of(discovering, 'up{rank="0"}', T0) == 1.0
    assert [(t.run_id, t.rank, t.up) for t in discovering.targets()] == [
        ("r7", "0", True),
        ("r7", "1", True),
    ]


def test_a_new_run_on_a_reused_port_leaves_the_old_run_down(
    exporter, discovering, tmp_path
) -> None:
    """A killed run's agent.json stays; a new run's agent takes its port. Each run is its own
    target: the old one is down, and the new run's samples never appear as the old run's."""
    exporter.body = 'a{run_id="old",rank="0"} 1\n'
    write_agent_json(tmp_path / "old", exporter.url, started_at=T0 - 100)
    discovering.scrape_once(T0)
    assert value_of(discovering, 'a{run_id="old"}', T0) == 1.0

    exporter.body = 'a{run_id="new",rank="0"} 2\n'  # old killed, new started on its port
    write_agent_json(tmp_path / "new", exporter.url)
    discovering.scrape_once(T0 + 1)

    up = {dict(s.labels)["run_id"]: s.value for s in samples(discovering, "up", T0 + 1)}
    assert up == {"old": 0.0, "new": 1.0}
    assert [dict(s.labels) for s in samples(discovering, "a", T0 + 1)] == [
        {"__name__": "a", "job": "lossguard-agent", "instance": exporter.instance}
        | {"run_id": "new", "rank": "0"}
    ]
    assert value_of(discovering, "a", T0 + 1) == 2.0
    new, old = discovering.targets()
    assert (new.run_id, new.up, new.last_error) == ("new", True, None)
    assert (old.run_id, old.rank, old.up) == ("old", "0", False)
    assert old.last_error == f"GET {exporter.url}: run new rank 0 answered, not run old rank 0"

    (tmp_path / "old" / "agent.json").unlink()  # the old target goes: its up ends
    discovering.scrape_once(T0 + 2)
    assert [dict(s.labels)["run_id"] for s in samples(discovering, "up", T0 + 2)] == ["new"]


def test_a_rank_that_moves_to_another_port_is_one_target(exporter, discovering, tmp_path) -> None:
    exporter.body = 'a{run_id="r1",rank="0"} 1\n'
    write_agent_json(tmp_path / "r1", f"http://127.0.0.1:{free_port()}/metrics")
    discovering.scrape_once(T0)
    write_agent_json(tmp_path / "r1", exporter.url)  # resumed, on another port
    discovering.scrape_once(T0 + 1)
    (up,) = samples(discovering, "up", T0 + 1)
    assert (dict(up.labels)["instance"], up.value) == (exporter.instance, 1.0)


def test_the_background_loop_scrapes_on_the_interval_and_stops(exporter) -> None:
    exporter.body = "a 1\n"
    source = source_for(exporter.url, interval_s=0.05)
    up = [Matcher("__name__", "=", "up")]

    def scrape_times() -> list[float]:
        return [t / 1000 for _, points in source.storage.select(up, 0, math.inf) for t, _ in points]

    try:
        source.start()
        times = wait_for(lambda: len(scrape_times()) >= 3 and scrape_times(), 10, "3 scrapes")
    finally:
        stopping = time.monotonic()
        source.close()
    assert time.monotonic() - stopping < 1
    assert not any(thread.name == "lossguard-scraper" for thread in threading.enumerate())
    assert all(t == pytest.approx(round(t / 0.05) * 0.05, abs=1e-6) for t in times)
    assert all(b - a >= 0.05 - 1e-6 for a, b in itertools.pairwise(times))
    assert value_of(source, "a", times[-1]) == 1.0


def test_a_target_down_from_the_start_is_up_0() -> None:
    """A target nobody listens on is down from its first scrape."""
    url = f"http://127.0.0.1:{free_port()}/metrics"
    source = source_for(url)
    try:
        source.scrape_once(T0)
        assert value_of(source, "up", T0) == 0.0
        assert samples(source, "absent(up == 1)", T0)[0].value == 1.0
    finally:
        source.close()


class EverNewSeries:
    """Each collection exposes 100 series never seen before: ``g{scrape, i}`` = scrape."""

    def __init__(self) -> None:
        self.scrapes = 0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.scrapes += 1
        family = GaugeMetricFamily("g", "new series every scrape", labels=["scrape", "i"])
        for i in range(100):
            family.add_metric([str(self.scrapes), str(i)], self.scrapes)
        yield family


def test_queries_see_whole_scrapes_while_the_loop_ingests(exporter) -> None:
    """Series come and go on the scrape thread while this thread reads them: every query sees
    exactly one scrape's 100 series, never a torn mix."""
    registry = CollectorRegistry()
    collector = EverNewSeries()
    registry.register(collector)
    exporter.body = registry
    source = source_for(exporter.url, interval_s=0.01, timeout_s=5)
    try:
        source.start()
        wait_for(lambda: samples(source, "g", time.time()), 10, "the first scrape")
        seen: set[str] = set()
        while len(seen) < 10:
            found = samples(source, "g", time.time())
            assert len(found) == 100
            scrapes = {dict(sample.labels)["scrape"] for sample in found}
            assert len(scrapes) == 1 and {s.value for s in found} == {float(*scrapes)}
            seen |= scrapes
    finally:
        source.close()
