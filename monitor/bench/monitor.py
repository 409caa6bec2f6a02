"""The monitor's side of the benchmark: the rules over simulated agents, scraped in the
background and evaluated on aligned ticks, as the daemon does; its CPU, latencies and memory."""

from __future__ import annotations

import math
import resource
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from lossguard.monitor.bench.fleet import AgentFleet
from lossguard.monitor.bench.prometheus import (
    rss_bytes,
)
from lossguard.monitor.promql import Value
from lossguard.monitor.rules.rulefile import (
    AlertingRule,
    load_rule_files,
    longest_range_s,
    metric_names,
)
from lossguard.monitor.rules.ruleset import RuleSet, Schedule
from lossguard.monitor.source_setup import RETENTION_MARGIN_S
from lossguard.monitor.sources.scrape import ScrapeSource

SERIES_QUERY = 'count({__name__=~".+"})'
SAMPLES_QUERY = "sum(scrape_samples_scraped)"


class TimedScrapeSource(ScrapeSource):
    """A scrape source that records how long each whole cycle took."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.cycle_seconds: list[float] = []

    def scrape_once(self, t: float | None = None) -> None:
        started = time.perf_counter()
        super().scrape_once(t)
        self.cycle_seconds.append(time.perf_counter() - started)


@dataclass(frozen=True)
class Latency:
    """A latency distribution in seconds."""

    p50: float
    p95: float
    max: float

    @classmethod
    def of(cls, durations: Sequence[float]) -> Latency:
        if not durations:
            return cls(math.nan, math.nan, math.nan)
        ordered = sorted(durations)
        p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        return cls(statistics.median(ordered), p95, ordered[-1])


@dataclass(frozen=True)
class MonitorBenchResult:
    """What one benchmark run measured, after the warm-up."""

    agents: int
    rules: int
    interval_s: float
    wall_s: float
    eval_cycles: int
    scrape_cycles: int
    cpu_share: float  # of one core, scraping and evaluation together
    agents_cpu_share: float  # of one core, the child serving the simulated agents
    evaluation: Latency
    scrape: Latency
    cycles_over_interval: int  # evaluation or scrape cycles longer than the interval
    series: int  # stored (only the metric names the rules select)
    samples_per_cycle: int  # exposed by all targets in one scrape cycle
    targets_up: int
    retention_s: float
    peak_rss_bytes: int
    rss_start_bytes: int  # the bench process before the first scrape
    rss_end_bytes: int

    @property
    def projected_sample_bytes(self) -> float:
        """Sample memory at full retention: 16 bytes per sample per stored series."""
        return self.series * self.retention_s / self.interval_s * 16

    @property
    def on_time(self) -> bool:
        return self.cycles_over_interval == 0

    @property
    def bytes_per_series(self) -> float:
        """Resident memory grown per stored series since before the first scrape."""
        return (self.rss_end_bytes - self.rss_start_bytes) / self.series if self.series else 0


def run_benchmark(
    *,
    agents: int,
    seconds_measured: float,
    interval_s: float = 1.0,
    rule_files: Sequence[str | Path] = ("alerts/lossguard.rules.yml",),
    warmup_cycles: int = 3,
) -> MonitorBenchResult:
    """Scrape ``agents`` simulated agents in the background and evaluate the rules on aligned
    ticks, as the daemon does, for ``warmup_cycles`` (and until as many scrape cycles have
    ended: the first parse whole) then ``seconds_measured``."""
    with AgentFleet(agents) as fleet:
        return measure_monitor(
            fleet,
            seconds_measured=seconds_measured,
            interval_s=interval_s,
            rule_files=rule_files,
            warmup_cycles=warmup_cycles,
        )


def measure_monitor(
    fleet: AgentFleet,
    *,
    seconds_measured: float,
    interval_s: float,
    rule_files: Sequence[str | Path],
    warmup_cycles: int,
) -> MonitorBenchResult:
    """:func:`run_benchmark` over the agents of a running ``fleet``."""
    groups = load_rule_files(rule_files)
    ruleset = RuleSet(groups)
    retention_s = longest_range_s(groups) + RETENTION_MARGIN_S
    urls = fleet.urls()
    rss_start = rss_bytes()
    source = TimedScrapeSource(
        static_targets=urls,
        runs_root=None,
        interval_s=interval_s,
        retention_s=retention_s,
        keep_names=metric_names(groups),
    )

    def query(rule: AlertingRule, t: float) -> Value:
        return source.query(rule.expr, t)

    evaluations: list[float] = []
    wake = threading.Event()
    schedule = Schedule(interval_s)

    def cycle() -> float:
        """One evaluation of the due groups, as the daemon runs it; its duration."""
        wake.wait(max(0.0, schedule.wake_time(time.time()) - time.time()))
        now = time.time()
        due = schedule.due(groups, now)
        started = time.perf_counter()
        ruleset.evaluate(query, now, groups=due, expr_query=source.query)
        schedule.done(groups, due, now)
        return time.perf_counter() - started

    source.start()
    try:
        for _ in range(warmup_cycles):
            cycle()
        while len(source.cycle_seconds) < warmup_cycles:  # first scrapes parse whole: slower
            cycle()
        scrapes_before = len(source.cycle_seconds)
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        agents_cpu_start = fleet.cpu_seconds()
        end = time.time() + seconds_measured
        while schedule.wake_time(time.time()) <= end:
            evaluations.append(cycle())
        cpu, wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
        agents_cpu = fleet.cpu_seconds() - agents_cpu_start
        scrapes = source.cycle_seconds[scrapes_before:]
        statuses = source.targets()
        series = _count(source, SERIES_QUERY)
        samples = _count(source, SAMPLES_QUERY)
        rss_end = rss_bytes()
    finally:
        source.close()
    return MonitorBenchResult(
        agents=len(urls),
        rules=len(ruleset.rules),
        interval_s=interval_s,
        wall_s=wall,
        eval_cycles=len(evaluations),
        scrape_cycles=len(scrapes),
        cpu_share=cpu / wall,
        agents_cpu_share=agents_cpu / wall,
        evaluation=Latency.of(evaluations),
        scrape=Latency.of(scrapes),
        cycles_over_interval=sum(1 for d in [*evaluations, *scrapes] if d > interval_s),
        series=series,
        samples_per_cycle=samples,
        targets_up=sum(1 for status in statuses if status.up),
        retention_s=retention_s,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        rss_start_bytes=rss_start,
        rss_end_bytes=rss_end,
    )


def _count(source: ScrapeSource, expr: str) -> int:
    """The single value of an aggregating ``expr`` now (0 when it finds nothing)."""
    found = source.query(expr, time.time())
    return int(found[0].value) if isinstance(found, list) and found else 0


def results_table(result: MonitorBenchResult) -> Table:
    def ms(value: float) -> str:
        return f"{value * 1000:.1f} ms"

    table = Table(
        title=f"lossguard-monitor: {result.rules} rules over {result.agents} simulated agents, "
        f"every {result.interval_s:g} s"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("measured (after warm-up)", f"{result.wall_s:.1f} s"),
        ("evaluation / scrape cycles", f"{result.eval_cycles} / {result.scrape_cycles}"),
        ("monitor CPU (share of one core)", f"{result.cpu_share:.1%}"),
        ("simulated agents' CPU (child process)", f"{result.agents_cpu_share:.1%}"),
        ("rule evaluation p50 / p95 / max", " / ".join(map(ms, _points(result.evaluation)))),
        ("scrape cycle p50 / p95 / max", " / ".join(map(ms, _points(result.scrape)))),
        ("every cycle within the interval", "yes" if not result.cycles_over_interval else "NO"),
        ("targets up", f"{result.targets_up} / {result.agents}"),
        ("samples exposed per cycle", f"{result.samples_per_cycle:,}"),
        ("series stored", f"{result.series:,}"),
        ("peak RSS", f"{result.peak_rss_bytes / 2**20:.0f} MiB"),
        (
            f"samples at full retention ({result.retention_s / 60:g} min)",
            f"{result.projected_sample_bytes / 2**20:.0f} MiB",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _points(latency: Latency) -> tuple[float, float, float]:
    return latency.p50, latency.p95, latency.max
