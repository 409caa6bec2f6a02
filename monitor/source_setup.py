"""Where the monitor's numbers come from, as its config says: Prometheus, or its own scraper
keeping what the rules read (and following them on a reload); the ``file_sd`` targets it writes
for a Prometheus; the runs that died here."""

from __future__ import annotations

from lossguard.monitor.config import MonitorConfig
from lossguard.monitor.notify.facts import FACT_METRICS
from lossguard.monitor.rules.rulefile import RuleGroup, longest_range_s, metric_names
from lossguard.monitor.runs import RUN_METRICS
from lossguard.monitor.sources import Source
from lossguard.monitor.sources.announced import AGENT_INFO
from lossguard.monitor.sources.discovery import discover
from lossguard.monitor.sources.file_sd import FileSdWriter
from lossguard.monitor.sources.liveness import DeadRun
from lossguard.monitor.sources.prometheus import PrometheusSource
from lossguard.monitor.sources.scrape import ScrapeSource

RETENTION_MARGIN_S = 60.0


def make_source(config: MonitorConfig, groups: list[RuleGroup]) -> Source:
    """The source of ``config.source`` for the rules of ``groups``."""
    if config.source == "prometheus":
        assert config.prometheus is not None  # checked by the config
        return PrometheusSource(config.prometheus.url, timeout_s=config.prometheus.timeout.seconds)
    scrape = config.scrape
    return ScrapeSource(
        static_targets=scrape.targets,
        file_sd_files=scrape.file_sd_files,
        runs_root=scrape.runs_root,
        interval_s=scrape.interval.seconds,
        timeout_s=None if scrape.timeout is None else scrape.timeout.seconds,
        job=scrape.job,
        retention_s=longest_range_s(groups) + RETENTION_MARGIN_S,
        keep_names=_kept_names(groups),
        forget_dead_after_s=scrape.forget_dead_runs_after.seconds,
    )


def follow_rules(source: Source, groups: list[RuleGroup]) -> None:
    """Reloaded rules: the monitor's scraper keeps what they read, as long as they read it."""
    if isinstance(source, ScrapeSource):
        source.retention_s = longest_range_s(groups) + RETENTION_MARGIN_S
        source.keep_names = _kept_names(groups)


def view_update_s(config: MonitorConfig) -> float:
    """The longest the monitor's view takes to show a new value: an evaluation, after a
    scrape where the monitor scrapes (its Prometheus has the value it alerted on)."""
    scraping = config.source != "prometheus"
    interval_s = config.rules.evaluation_interval.seconds
    return interval_s + (config.scrape.interval.seconds if scraping else 0.0)


def dead_runs(config: MonitorConfig, source: Source, t: float) -> list[DeadRun]:
    """The runs whose process died here: the scraper's, or (with source: prometheus) from a
    look at ``scrape.runs_root``, so that Prometheus scraping ``/metrics`` sees them."""
    if isinstance(source, ScrapeSource):
        return source.dead_runs()
    scrape = config.scrape
    if scrape.runs_root is None:
        return []
    forget_after_s = scrape.forget_dead_runs_after.seconds
    return discover(scrape.runs_root, now=t, forget_after_s=forget_after_s).dead


def file_sd_writer(config: MonitorConfig) -> FileSdWriter | None:
    """The ``scrape.file_sd_path`` writer (None: not configured); it looks at the runs as
    often as the scraper does."""
    scrape = config.scrape
    if scrape.file_sd_path is None or scrape.runs_root is None:
        return None
    return FileSdWriter(
        scrape.file_sd_path,
        scrape.runs_root,
        interval_s=scrape.interval.seconds,
        forget_dead_after_s=scrape.forget_dead_runs_after.seconds,
        job=scrape.job,
    )


def _kept_names(groups: list[RuleGroup]) -> frozenset[str] | None:
    """The metric names a scrape keeps: those the rules, the notifications, the HTTP API and
    the runs' announcements read (None: all, when a rule selects names by regex)."""
    names = metric_names(groups)
    if names is None:
        return None
    return names | FACT_METRICS | set(RUN_METRICS.values()) | {AGENT_INFO}
