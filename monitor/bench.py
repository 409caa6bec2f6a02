"""The monitor's benchmark: the default rules over N simulated agents, scraped and evaluated on
the daemon's schedule, then the same agents, rules and interval under Debian's Prometheus, back
to back (:mod:`lossguard.monitor.bench_prometheus`). The agents are served by a child process,
so only each engine's own work counts against its CPU share.

``python -m lossguard.monitor.bench --agents 256 512 --seconds 30 --interval 1s``
"""

from __future__ import annotations

import argparse
import math
import resource
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lossguard.monitor.bench_fleet import AgentFleet
from lossguard.monitor.bench_prometheus import (
    PrometheusBenchResult,
    prometheus_binary,
    rss_bytes,
    run_prometheus_baseline,
)
from lossguard.monitor.daemon import RETENTION_MARGIN_S
from lossguard.monitor.promql import Value
from lossguard.monitor.rules.rulefile import (
    AlertingRule,
    RuleError,
    load_rule_files,
    longest_range_s,
    metric_names,
)
from lossguard.monitor.rules.ruleset import RuleSet, Schedule
from lossguard.monitor.sources.scrape import ScrapeSource
from lossguard.monitor.validation import seconds

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
        ruleset.evaluate(query, now, groups=due)
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


@dataclass(frozen=True)
class Comparison:
    """Both engines over one fleet, back to back (Prometheus None where not run)."""

    monitor: MonitorBenchResult
    prometheus: PrometheusBenchResult | None

    @property
    def cpu_ratio(self) -> float:
        """The monitor's CPU over Prometheus's (NaN without Prometheus)."""
        if self.prometheus is None or not self.prometheus.cpu_share > 0:
            return math.nan
        return self.monitor.cpu_share / self.prometheus.cpu_share

    @property
    def memory_ratio(self) -> float:
        """The monitor's memory per stored series over Prometheus's."""
        if self.prometheus is None or not self.prometheus.bytes_per_series > 0:
            return math.nan
        return self.monitor.bytes_per_series / self.prometheus.bytes_per_series


def compare(
    *,
    agents: int,
    seconds_measured: float,
    interval_s: float,
    rule_files: Sequence[str | Path],
    warmup_cycles: int,
    prometheus: bool = True,
) -> Comparison:
    """The monitor, then Prometheus, over one fleet of ``agents``, each for
    ``seconds_measured`` after ``warmup_cycles``."""
    with AgentFleet(agents) as fleet:
        options = {
            "seconds_measured": seconds_measured,
            "interval_s": interval_s,
            "rule_files": rule_files,
            "warmup_cycles": warmup_cycles,
        }
        monitor = measure_monitor(fleet, **options)  # type: ignore[arg-type]
        baseline = run_prometheus_baseline(fleet.urls(), **options) if prometheus else None  # type: ignore[arg-type]
    return Comparison(monitor, baseline)


def comparison_table(rows: Sequence[Comparison]) -> Table:
    """One row per engine and fleet size."""
    table = Table(title="lossguard-monitor and Prometheus: the same agents, rules and interval")
    for column in (
        "agents", "interval", "engine", "CPU (of a core)", "CPU per cycle", "monitor / Prometheus",
        "on time", "evaluation p50 / max", "scrape cycle p50 / max", "series", "RSS",
        "bytes per series",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column == "engine" else "right")
    for row in rows:
        m, p = row.monitor, row.prometheus
        table.add_row(
            str(m.agents), f"{m.interval_s:g} s", "lossguard-monitor", f"{m.cpu_share:.1%}",
            _ms(m.cpu_share * m.interval_s), f"{row.cpu_ratio:.2f}x CPU", _yes(m.on_time),
            f"{_ms(m.evaluation.p50)} / {_ms(m.evaluation.max)}",
            f"{_ms(m.scrape.p50)} / {_ms(m.scrape.max)}", f"{m.series:,}",
            _mib(m.rss_end_bytes), f"{m.bytes_per_series:,.0f}",
        )  # fmt: skip
        if p is not None:
            table.add_row(
                "", "", f"prometheus {p.version}", f"{p.cpu_share:.1%}",
                _ms(p.cpu_share * p.interval_s), f"{row.memory_ratio:.2f}x memory/series",
                _yes(p.on_time), f"p99 {_ms(p.rule_group_p99_s)}",
                f"interval p99 {_ms(p.scrape_interval_p99_s)}", f"{p.series:,}",
                _mib(p.rss_end_bytes), f"{p.bytes_per_series:,.0f}",
            )  # fmt: skip
    return table


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _mib(size: float) -> str:
    return f"{size / 2**20:.0f} MiB"


def _yes(on_time: bool) -> str:
    return "yes" if on_time else "NO"


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lossguard.monitor.bench",
        description="Benchmark the monitor against Prometheus: the rules over simulated agents "
        "on a fixed interval.",
    )
    parser.add_argument(
        "--agents", type=int, nargs="+", default=[256], help="simulated agents, one run each (256)"
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds (30)")
    parser.add_argument("--interval", default="1s", help="scrape and evaluation interval (1s)")
    parser.add_argument("--warmup", type=int, default=3, help="cycles not measured (3)")
    parser.add_argument(
        "--rules", action="append", help="rule file (repeatable; alerts/lossguard.rules.yml)"
    )
    parser.add_argument(
        "--no-prometheus", action="store_true", help="the monitor only, no Prometheus baseline"
    )
    parser.add_argument(
        "--details", action="store_true", help="also each monitor run's detailed table"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(width=200)  # the comparison is wide; cut, it would say nothing
    rows = []
    try:
        interval_s = seconds(args.interval)
        if min(args.agents) < 1 or not args.seconds > 0 or args.warmup < 0 or not interval_s > 0:
            raise ValueError("--agents, --seconds and --interval must be positive, --warmup ≥ 0")
        if not args.no_prometheus:
            prometheus_binary()
        for agents in args.agents:
            rows.append(
                compare(
                    agents=agents,
                    seconds_measured=args.seconds,
                    interval_s=interval_s,
                    rule_files=args.rules or ["alerts/lossguard.rules.yml"],
                    warmup_cycles=args.warmup,
                    prometheus=not args.no_prometheus,
                )
            )
            if args.details:
                console.print(results_table(rows[-1].monitor))
    except (ValueError, RuleError, RuntimeError) as exc:
        print(f"lossguard.monitor.bench: {exc}", file=sys.stderr)
        return 2
    console.print(comparison_table(rows))
    command = shlex.join(["python", "-m", "lossguard.monitor.bench", *sys.argv[1:]])
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    console.print(f"command: {command}\nload average at the end: {load}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
