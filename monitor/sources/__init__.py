"""Where the monitor gets its numbers: its own scrapes of agents, or a Prometheus server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lossguard.monitor.promql import Value


class SourceError(Exception):
    """A query the source could not answer (one line: what failed, and why)."""


@dataclass(frozen=True)
class TargetStatus:
    """One scrape target as last seen."""

    url: str
    job: str
    instance: str
    run_id: str | None
    up: bool | None  # None: not scraped yet; False: the last scrape failed, or a dead run
    last_scrape: float | None  # wall time of the last attempt
    last_error: str | None
    scrape_duration_s: float | None
    rank: str | None = None  # with run_id: the rank's ``rank`` label


class Source(Protocol):
    """Answers rule expressions at a time; knows its targets."""

    def start(self) -> None: ...
    def close(self) -> None: ...
    def query(
        self, expr: str, t: float
    ) -> Value: ...  # raises PromQLError (bad expr) or SourceError
    def targets(self) -> list[TargetStatus]: ...
    def history_start(self) -> float | None:
        """Since when the source has data (None: none yet); alerts that need an older window
        are held, not resolved, until it has that much."""
        ...
