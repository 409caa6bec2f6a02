"""Where the Guard's records go: the run's metrics log, Weights & Biases, the progress display.

A record is a flat mapping (``kind``, ``step``, numbers); ``display`` is false for the sampled
side records (FP8 health, gradient diagnostics) that a progress line should not show.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from lossguard.agent.telemetry.progress import ProgressDisplay
from lossguard.agent.telemetry.wandb_logger import WandbLogger
from lossguard.common.rundir.jsonl import JsonlLog


class Sink(Protocol):
    def write(self, record: Mapping[str, Any], *, display: bool) -> None: ...
    def close(self) -> None: ...


class MetricsLogSink:
    """``metrics.jsonl``: every record, one line each."""

    def __init__(self, log: JsonlLog) -> None:
        self.log = log

    def write(self, record: Mapping[str, Any], *, display: bool) -> None:
        self.log.append(record)

    def close(self) -> None:
        self.log.close()


class WandbSink:
    """Every record's numbers to the W&B run."""

    def __init__(self, logger: WandbLogger) -> None:
        self.logger = logger

    def write(self, record: Mapping[str, Any], *, display: bool) -> None:
        self.logger.log(record)

    def close(self) -> None:
        self.logger.finish()


class DisplaySink:
    """The terminal's progress display: the records meant to be shown."""

    def __init__(self, display: ProgressDisplay) -> None:
        self.display = display

    def write(self, record: Mapping[str, Any], *, display: bool) -> None:
        if display:
            self.display.update(record)

    def close(self) -> None:
        self.display.close()
