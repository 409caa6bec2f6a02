"""``lossguard-agent`` as if its device were a GPU that NVML knows (this machine has none):
NVML's readings and identity stand in; the training, the exporter and the rest are real.

``python -m tests.support.fake_gpu_agent run CONFIG`` is ``lossguard-agent run CONFIG``."""

from __future__ import annotations

import runpy
import sys

import torch

from lossguard.agent.telemetry import hub
from tests.support.dcgm_exporter import IDENTITY


class StandInNvml:
    """The agent's :class:`~lossguard.agent.telemetry.hardware.Nvml`, with fixed answers."""

    available = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def identity(self) -> dict[str, str]:
        return dict(IDENTITY)

    def sample(self) -> dict[str, float]:
        return {
            "utilization_ratio": 0.93,
            "power_watts": 605.0,
            "temperature_celsius": 63.0,
            "memory_used_bytes": 60.0 * 2**30,
            "memory_total_bytes": 80.0 * 2**30,
        }

    def close(self) -> None:
        """Nothing to shut down."""


if __name__ == "__main__":
    setattr(hub, "Nvml", StandInNvml)  # noqa: B010 (a module attribute, replaced on purpose)
    sys.argv[0] = "lossguard-agent"
    runpy.run_module("lossguard.agent.cli", run_name="__main__", alter_sys=True)
