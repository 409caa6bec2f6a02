"""Both engines over one fleet, back to back, and the table that puts them side by side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from lossguard.monitor.bench.fleet import AgentFleet
from lossguard.monitor.bench.monitor import MonitorBenchResult, measure_monitor
from lossguard.monitor.bench.prometheus import (
    PrometheusBenchResult,
    run_prometheus_baseline,
)


@dataclass(frozen=True)
class Comparison:
    """Both engines over one fleet, back to back (Prometheus None where not run)."""

    monitor: MonitorBenchResult
    prometheus: PrometheusBenchResult | None

    @property
    def cpu_ratio(self) -> float | None:
        """The monitor's CPU over Prometheus's (None: no Prometheus, or it used none)."""
        if self.prometheus is None or not self.prometheus.cpu_share > 0:
            return None
        return self.monitor.cpu_share / self.prometheus.cpu_share

    @property
    def memory_ratio(self) -> float | None:
        """The monitor's memory per stored series over Prometheus's (None as for CPU)."""
        if self.prometheus is None or not self.prometheus.bytes_per_series > 0:
            return None
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
            _ms(m.cpu_share * m.interval_s), _ratio(row, row.cpu_ratio, "CPU"), _yes(m.on_time),
            f"{_ms(m.evaluation.p50)} / {_ms(m.evaluation.max)}",
            f"{_ms(m.scrape.p50)} / {_ms(m.scrape.max)}", f"{m.series:,}",
            _mib(m.rss_end_bytes), f"{m.bytes_per_series:,.0f}",
        )  # fmt: skip
        if p is not None:
            table.add_row(
                "", "", f"prometheus {p.version}", f"{p.cpu_share:.1%}",
                _ms(p.cpu_share * p.interval_s), _ratio(row, row.memory_ratio, "memory/series"),
                _yes(p.on_time), f"p99 {_ms(p.rule_group_p99_s)}",
                f"interval p99 {_ms(p.scrape_interval_p99_s)}", f"{p.series:,}",
                _mib(p.rss_end_bytes), f"{p.bytes_per_series:,.0f}",
            )  # fmt: skip
    return table


def _ratio(row: Comparison, ratio: float | None, of: str) -> str:
    """``0.50x CPU``; what stands in its place where there is nothing to divide by."""
    if row.prometheus is None:
        return "n/a (no Prometheus)"
    return "n/a (Prometheus measured 0)" if ratio is None else f"{ratio:.2f}x {of}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _mib(size: float) -> str:
    return f"{size / 2**20:.0f} MiB"


def _yes(on_time: bool) -> str:
    return "yes" if on_time else "NO"
