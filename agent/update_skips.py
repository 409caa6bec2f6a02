"""Which optimizer updates a step skips, on the device and without a host sync: non-finite
ones (``telemetry.skip_nonfinite``) and spikes (``mitigation.skip_spikes``, rung 1), counted
in the log interval. With a GradScaler the scaler skips non-finite steps itself; they are
counted only."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from lossguard.agent.config import Config
from lossguard.agent.mitigation import SpikeSkipper
from lossguard.agent.telemetry.collector import skips_on_device
from lossguard.agent.telemetry.interval import Interval
from lossguard.agent.telemetry.spikes import SpikeDetector

log = logging.getLogger("lossguard.agent")


class UpdateSkips:
    """Feeds the optimizer's ``found_inf`` (fused AdamW, SPAM) each step (``telemetry_on``:
    the detectors that flag spikes run)."""

    def __init__(
        self,
        config: Config,
        *,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
        telemetry_on: bool,
        device: torch.device,
        world_size: int,
    ) -> None:
        self.config = config
        self.optimizer = optimizer
        self.scaler = scaler
        self.on_device = skips_on_device(optimizer, scaler)
        self.spikes: SpikeSkipper | None = None
        if not config.mitigation.skip_spikes:
            return
        if not telemetry_on or not self.on_device:
            log.warning(
                "mitigation.skip_spikes is off for this run: skipping an update on the device "
                "needs telemetry, a fused optimizer (or SPAM) and no GradScaler"
            )
            return
        distributed = world_size > 1
        self.spikes = SpikeSkipper(config.mitigation, device, distributed=distributed)

    def after_step(
        self, norm_bad: torch.Tensor, detectors: Mapping[str, SpikeDetector], interval: Interval
    ) -> None:
        """Skip (and count) this step's update if its gradient norm is not finite or, with
        rung 1, it is a spike."""
        if self.scaler is not None:
            interval.skipped += norm_bad  # the GradScaler skips these steps itself
        elif self.on_device and (self.config.telemetry.skip_nonfinite or self.spikes):
            skip = norm_bad if self.config.telemetry.skip_nonfinite else norm_bad & False
            interval.skipped += skip
            if self.spikes is not None:  # rung 1: a spike's update is skipped too
                spike = self.spikes.flag(detectors) & ~skip
                interval.skipped_spikes += spike
                skip = skip | spike
            self.optimizer.found_inf = skip.float()  # type: ignore[union-attr]

    def reset(self) -> None:
        """After a restore: no spikes in a row in the timeline training goes on from."""
        if self.spikes is not None:
            self.spikes.reset()
