"""NoTelemetry: the telemetry hub's stand-in while ``telemetry.enabled`` is off, so that the parts
of the agent call one interface whether telemetry runs or not. Nothing is detected, sampled or
exported: every call does nothing, and the queries answer "nothing there"."""

from __future__ import annotations

from typing import Any

import torch

from lossguard.agent.telemetry.fp8_fidelity import Replay
from lossguard.agent.telemetry.hub import NamedStates, SignalStats
from lossguard.agent.telemetry.spikes import SpikeDetector


class NoTelemetry:
    """The ``Telemetry`` interface, doing nothing."""

    enabled = False

    def __init__(self) -> None:
        self.detectors: dict[str, SpikeDetector] = {}
        self.urls: list[str] = []
        self.fp8_overflow: tuple[str, float] | None = None

    def on_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor | None:
        return None

    def exclude(self, seconds: float) -> None:
        pass

    def step_done(self, step: int) -> None:
        pass

    def sampling(self, next_step: int) -> None:
        pass

    def collect_samples(
        self, step: int, loss: torch.Tensor, replay: Replay | None = None
    ) -> list[dict[str, Any]]:
        return []

    def episode_active(self) -> bool:
        return False

    def stats(self) -> torch.Tensor | None:
        return None

    def rebase(self) -> None:
        pass

    def publish(
        self, record: dict[str, Any], by_signal: SignalStats, tokens_local: float, elapsed: float
    ) -> None:
        pass

    def count_optimizer(self) -> None:
        pass

    def publish_eval(self, val_loss: float) -> None:
        pass

    def resync_totals(self, step: int) -> SignalStats:
        return {}

    def announce(self, control: str | None) -> None:
        pass

    def checkpoint_started(self) -> None:
        pass

    def checkpoint_finished(self, seconds: float | None, named: NamedStates) -> None:
        pass

    def states_changed(self, named: NamedStates) -> None:
        pass

    def snapshots(self, enabled: bool, held_bytes: int) -> None:
        pass

    def command_applied(self, command: str, ok: bool) -> None:
        pass

    def control_refused(self, reason: str) -> None:
        pass

    def paused(self, paused: bool) -> None:
        pass

    def close(self) -> None:
        pass


NO_TELEMETRY = NoTelemetry()
