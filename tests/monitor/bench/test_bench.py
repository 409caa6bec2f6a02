"""The monitor benchmark runs end to end: simulated agents in a child process, scraped and
evaluated on the daemon's schedule, then by a real Prometheus, and reports numbers that make
sense."""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from lossguard.common.catalogue import CATALOGUE
from lossguard.monitor.bench.compare import Comparison, compare, comparison_table
from lossguard.monitor.bench.fleet import AgentFleet
from lossguard.monitor.bench.monitor import (
    Latency,
    MonitorBenchResult,
    results_table,
    run_benchmark,
)
from tests.support.processes import REPO

pytestmark = pytest.mark.live

AGENTS = 4


def test_benchmark_measures_scraping_and_evaluation() -> None:
    result = run_benchmark(
        agents=AGENTS,
        seconds_measured=2.0,
        interval_s=0.5,
        rule_files=[REPO / "alerts" / "lossguard.rules.yml"],
        warmup_cycles=2,
    )
    assert result.rules > 0
    assert result.eval_cycles >= 3 and result.scrape_cycles >= 3
    assert 0 < result.cpu_share < 2
    # the agents' child renders from a template: under a clock tick for 4 agents over 2 s
    assert math.isfinite(result.agents_cpu_share) and 0 <= result.agents_cpu_share < 2
    assert 0 < result.evaluation.p50 <= result.evaluation.p95 <= result.evaluation.max
    assert 0 < result.scrape.p50 <= result.scrape.p95 <= result.scrape.max
    assert result.targets_up == AGENTS
    assert result.samples_per_cycle >= AGENTS * len(CATALOGUE) * 2  # catalogue-sized
    assert AGENTS * 20 <= result.series < result.samples_per_cycle  # the rules' names only
    assert result.peak_rss_bytes > 0 and math.isfinite(result.projected_sample_bytes)
    assert result.rss_end_bytes > 0
    assert results_table(result).row_count > 5


def test_prometheus_runs_beside_the_monitor_over_the_same_agents() -> None:
    row = compare(
        agents=AGENTS,
        seconds_measured=2.0,
        interval_s=0.5,
        rule_files=[REPO / "alerts" / "lossguard.rules.yml"],
        warmup_cycles=2,
    )
    baseline = row.prometheus
    assert baseline is not None and baseline.version.startswith("2.")
    assert baseline.targets_up == AGENTS and row.monitor.targets_up == AGENTS
    assert 0 < baseline.cpu_share < 2 and row.cpu_ratio is not None and row.cpu_ratio > 0
    # Prometheus stores every exposed series; the monitor only those of the names the rules read
    assert baseline.series >= row.monitor.samples_per_cycle > row.monitor.series
    assert baseline.rss_end_bytes > baseline.rss_start_bytes > 0
    assert 0 < baseline.scrape_interval_p99_s < 5 and baseline.missed_iterations >= 0
    assert comparison_table([row]).row_count == 2


def test_without_prometheus_the_ratio_says_so_instead_of_nan() -> None:
    """``--no-prometheus``: nothing to divide by, and the table says so in words."""
    latency = Latency(0.010, 0.020, 0.030)
    monitor = MonitorBenchResult(
        agents=4, rules=20, interval_s=1.0, wall_s=2.0, eval_cycles=2, scrape_cycles=2,
        cpu_share=0.05, agents_cpu_share=0.01, evaluation=latency, scrape=latency,
        cycles_over_interval=0, series=100, samples_per_cycle=400, targets_up=4,
        retention_s=600.0, peak_rss_bytes=2**26, rss_start_bytes=2**25, rss_end_bytes=2**26,
    )  # fmt: skip
    row = Comparison(monitor, None)
    assert row.cpu_ratio is None and row.memory_ratio is None
    console = Console(file=io.StringIO(), width=250, record=True)
    console.print(comparison_table([row]))
    text = console.export_text()
    assert "n/a (no Prometheus)" in text and "nan" not in text.lower()


def test_fleet_child_ends_when_closed() -> None:
    with AgentFleet(1) as fleet:
        assert len(fleet.urls()) == 1
    assert fleet.process.returncode is not None
