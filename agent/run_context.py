"""RunContext: who and where this rank is in its run, handed to the parts of the agent instead of
long argument lists (rank, world size, the control group, the device, the run id, the audit
trail and the telemetry)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lossguard.agent.telemetry.hub import Telemetry
from lossguard.agent.telemetry.no_telemetry import NO_TELEMETRY, NoTelemetry

Events = Callable[..., None]
"""Appends one record to the audit trail: ``event(kind, **fields)`` (rank 0 writes it)."""


@dataclass(frozen=True)
class RunContext:
    """This rank of the run ``run_id``: ``group`` is the agent's control process group (gloo;
    None in a single process), ``event`` appends to the audit trail, ``telemetry`` is the hub
    (``NO_TELEMETRY`` while it is off or not started yet)."""

    rank: int
    world_size: int
    group: Any
    device: torch.device
    run_id: str
    event: Events
    telemetry: Telemetry | NoTelemetry = NO_TELEMETRY

    @property
    def main(self) -> bool:
        """Rank 0: the rank that owns the run directory, the control server and the store."""
        return self.rank == 0

    def with_telemetry(self, telemetry: Telemetry | NoTelemetry) -> RunContext:
        return dataclasses.replace(self, telemetry=telemetry)
