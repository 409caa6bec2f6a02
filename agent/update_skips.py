"""Which optimizer updates a step skips, on the device and without a host sync: non-finite
ones (``telemetry.skip_nonfinite``) and spikes (``mitigation.skip_spikes``, rung 1), counted
in the log interval. With a GradScaler the scaler skips non-finite steps itself; they are
counted only."""

from __future__ import annotations

import logging

import torch

from lossguard.agent.config import GuardConfig
from lossguard.agent.mitigation import SpikeSkipper
from lossguard.agent.restored import Restored
from lossguard.agent.run_context import RunContext
from lossguard.agent.telemetry.hub import skips_on_device
from lossguard.agent.telemetry.interval import Interval

log = logging.getLogger("lossguard.agent")


class UpdateSkips:
    """Feeds the telemetry's detectors each step and the optimizer's ``found_inf`` (fused
    AdamW, SPAM) from what they flag."""

    def __init__(
        self,
        ctx: RunContext,
        config: GuardConfig,
        *,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        self.telemetry = ctx.telemetry
        self.config = config
        self.optimizer = optimizer
        self.scaler = scaler
        self.on_device = skips_on_device(optimizer, scaler)
        self.spikes: SpikeSkipper | None = None
        if not config.mitigation.skip_spikes:
            return
        if not ctx.telemetry.enabled or not self.on_device:
            log.warning(
                "mitigation.skip_spikes is off for this run: skipping an update on the device "
                "needs telemetry, a fused optimizer (or SPAM) and no GradScaler"
            )
            return
        distributed = ctx.world_size > 1
        self.spikes = SpikeSkipper(config.mitigation, ctx.device, distributed=distributed)

    def after_step(self, loss: torch.Tensor, norm: torch.Tensor, interval: Interval) -> None:
        """Feed the detectors; skip (and count) this step's update if its gradient norm is not
        finite or, with rung 1, it is a spike. Skips go on the grad norm only: it is the same
        on every rank after DDP's all-reduce, so every replica skips the same steps (a rank's
        own loss is counted, not acted on)."""
        norm_bad = self.telemetry.on_step(loss, norm)
        if norm_bad is None:  # no detectors (telemetry off): nothing is flagged
            return
        if self.scaler is not None:
            interval.skipped += norm_bad  # the GradScaler skips these steps itself
        elif self.on_device and (self.config.telemetry.skip_nonfinite or self.spikes):
            skip = norm_bad if self.config.telemetry.skip_nonfinite else norm_bad & False
            interval.skipped += skip
            if self.spikes is not None:  # rung 1: a spike's update is skipped too
                spike = self.spikes.flag(self.telemetry.detectors) & ~skip
                interval.skipped_spikes += spike
                skip = skip | spike
            self.optimizer.found_inf = skip.float()  # type: ignore[union-attr]

    def restored(self, restored: Restored) -> None:
        """After a restore: no spikes in a row in the timeline training goes on from."""
        if self.spikes is not None:
            self.spikes.reset()
