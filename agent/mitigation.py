"""Rung 1 of the mitigation ladder (``mitigation.skip_spikes``): skip, on the device, the
optimizer update of a step whose loss (by default; ``mitigation.signals``: also or instead the
gradient norm) is a spike.

The gradient norm is left out by default: on small batches it is heavy-tailed, and a fault-free
run's natural excursions (4 to 5 times its mean with an ordinary loss) lie as far above its
window as a corrupt batch's, while the loss tells them apart (docs/benchmarks.md).

A spike here: the value is finite and more than ``zscore`` standard deviations above the mean
of its detector's rolling window (``telemetry.spikes.window`` values that were in band), once
the window holds ``min_history`` values; upward only. The flag is a device tensor fed into the
optimizer's ``found_inf`` (fused AdamW, SPAM), as a non-finite step's is: the update is not
applied and the optimizer's step count does not advance, so Adam's bias correction goes on as
if the batch had never been seen. More than ``max_consecutive`` spikes in a row are not
skipped (the rung ends, the episode goes on to the alerts) until a step that is no spike.
Under torchrun the flag is the maximum over ranks (one scalar all-reduce on the device per
step), so every replica skips the same steps.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lossguard.agent.config import MitigationConfig
from lossguard.agent.distributed import all_reduce_max_tensor
from lossguard.agent.telemetry.spikes import SpikeDetector


class SpikeSkipper:
    """Decides each step, on the device, whether its update is skipped as a spike."""

    def __init__(self, cfg: MitigationConfig, device: torch.device, *, distributed: bool) -> None:
        self.cfg = cfg
        self.distributed = distributed
        self._run = torch.zeros((), device=device)  # consecutive spike steps so far

    def flag(self, detectors: Mapping[str, SpikeDetector]) -> torch.Tensor:
        """Whether this step's update is to be skipped (a bool device tensor); call after the
        detectors took the step's values. No host sync."""
        spike = torch.zeros((), dtype=torch.bool, device=self._run.device)
        for signal in self.cfg.signals:
            above = detectors[signal].exceeds(self.cfg.zscore, self.cfg.min_history)
            spike |= above.to(spike.device)
        if self.distributed:
            spike = all_reduce_max_tensor(spike.to(torch.uint8), "all_reduce: spike skip").bool()
        self._run = (self._run + 1) * spike
        return spike & (self._run <= self.cfg.max_consecutive)

    def reset(self) -> None:
        """After a restore: no spikes in a row in the timeline training goes on from."""
        self._run.zero_()
