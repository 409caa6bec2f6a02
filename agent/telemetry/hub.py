"""The telemetry hub of one rank: the detectors, the samplers and the exporter that a run senses
with, at a cost the loop does not feel (``NoTelemetry``, in ``no_telemetry``, stands in when
``telemetry.enabled`` is off).

Per step: spike and non-finite detection on the device (no sync) and three host-side metric
updates (step, heartbeat, step time). Per log interval: the detector statistics join Guard's
one host sync, then every gauge is published. Sampled steps: FP8 health, the FP8 fidelity check
and gradient diagnostics (``samplers``). Reads never wait on the device except at those points.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lossguard.agent.config import GuardConfig
from lossguard.agent.distributed import all_gather_objects, all_reduce_max_tensor
from lossguard.agent.telemetry.exporter import Exporter
from lossguard.agent.telemetry.fp8_fidelity import Replay
from lossguard.agent.telemetry.hardware import Nvml, Peak, memory_stats, resolve_peak
from lossguard.agent.telemetry.samplers import Samplers
from lossguard.agent.telemetry.spikes import STAT_FIELDS, SpikeBank
from lossguard.common import __version__
from lossguard.common.catalogue import (
    LEVEL_SHIFT_SIGNALS,
    MEMORY_KINDS,
    OPTIMIZER_COUNTERS,
    SIGNALS,
)
from lossguard.common.control.address import SUPERVISOR_CONTROL_ENV, public_host
from lossguard.common.control.protocol import PROTOCOL_VERSION
from lossguard.common.registry import AgentMetrics
from lossguard.common.rundir.checkpoints import CheckpointMeta
from lossguard.common.rundir.directory import git_commit

log = logging.getLogger("lossguard.agent")


SignalStats = dict[str, dict[str, float]]
NamedStates = Callable[[], dict[str, CheckpointMeta | None]]
"""Finds the latest, best and last good states (rank 0: it lists the checkpoints)."""


def signal_stats(stats: list[float]) -> SignalStats:
    """Split ``Telemetry.stats()`` read to the host into each signal's named fields."""
    width = len(STAT_FIELDS)
    return {
        signal: dict(zip(STAT_FIELDS, stats[i * width : (i + 1) * width], strict=True))
        for i, signal in enumerate(SIGNALS)
    }


def _total_key(name: str, **labels: str) -> str:
    """The key of a counter's exported running total, one per label set."""
    return name + "".join(f"/{key}={value}" for key, value in sorted(labels.items()))


def skips_on_device(
    optimizer: torch.optim.Optimizer | None, scaler: torch.amp.GradScaler | None
) -> bool:
    """A fused optimizer (and one that says it honours ``found_inf``, as lossguard's SPAM
    does) skips a step on a device flag (``found_inf``) without a host sync; with a
    GradScaler, the scaler already skips non-finite steps itself."""
    if optimizer is None or scaler is not None:
        return False
    if optimizer.defaults.get("fused") or getattr(optimizer, "honours_found_inf", False):
        return True
    log.warning(
        "the optimizer is not fused: non-finite steps are counted but their updates cannot be "
        "skipped without a host sync (use e.g. torch.optim.AdamW(..., fused=True))"
    )
    return False


class Telemetry:
    """Detectors, samplers and the exporter of one rank."""

    enabled = True

    def __init__(
        self,
        config: GuardConfig,
        *,
        model: nn.Module,
        device: torch.device,
        rank: int,
        world_size: int,
        run_id: str,
        max_steps: int | None,
        flops_per_token: float,
        group: Any,
        loss_scaling: bool = False,
    ) -> None:
        cfg = config.telemetry
        self.config = config
        self.max_steps = max_steps
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        # Under a GradScaler, overflowing grad norms are the scaler at work, not divergence.
        self.spikes = SpikeBank(
            cfg.spikes, device, [not (loss_scaling and s == "grad_norm") for s in SIGNALS]
        )
        self.detectors = dict(zip(SIGNALS, self.spikes.detectors, strict=True))
        self.nvml = Nvml(device)
        self.metrics = AgentMetrics(run_id, rank, nvml=self.nvml.available)
        identity = self.nvml.identity()
        if identity is not None:  # the join key with DCGM's series: host name and GPU
            self.metrics.set("gpu_info", 1, Hostname=socket.gethostname(), **identity)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        port = cfg.port + local_rank if cfg.port else 0
        self.exporter = Exporter.start(self.metrics.registry, cfg.host, port)
        url = self.exporter.url(public_host(cfg.host))
        self.urls = all_gather_objects(url, group, "all_gather_object: exporter URLs")
        self.peak: Peak | None = resolve_peak(device, config.precision.dtype, cfg.peak_flops)
        self.samplers = Samplers(config, model, self.metrics)
        self._exported_totals: dict[str, float] = {}
        self._last_step_time = time.perf_counter()
        self._last_step_clock = time.monotonic()
        self.metrics.track(
            "last_step_age_seconds", lambda: time.monotonic() - self._last_step_clock
        )
        self._publish_static(model, run_id)
        if rank != 0:  # rank 0 announces once its control server listens (``announce``)
            self.announce(control=None)

    # ------------------------------------------------------------ per step

    def on_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """Feed the detectors; returns the device flag "this step saw a non-finite value"
        (``NoTelemetry``: None, no detector ran)."""
        values = torch.stack((loss.detach().float(), grad_norm.reshape(())))  # SIGNALS order
        return self.spikes.update(values).any()

    def exclude(self, seconds: float) -> None:
        """Time that was not training (evaluation, a pause) stays out of the step time."""
        self._last_step_time += seconds

    def step_done(self, step: int) -> None:
        """Host-side heartbeat; never touches the device."""
        now = time.perf_counter()
        self.metrics.observe("step_duration_seconds", now - self._last_step_time)
        self._last_step_time = now
        self._last_step_clock = time.monotonic()
        self.metrics.set("step", step)
        self.metrics.set("last_step_timestamp_seconds", time.time())

    def sampling(self, next_step: int) -> None:
        """Before the forward of a sampled step: arm the FP8 sampler, and take the RNG states
        for an FP8 fidelity check (again at each call: a restore in between moves them)."""
        self.samplers.arm(next_step)

    def collect_samples(
        self, step: int, loss: torch.Tensor, replay: Replay | None = None
    ) -> list[dict[str, Any]]:
        """After backward on a sampled step: FP8 health, FP8 fidelity (when given ``replay``)
        and gradient diagnostics records."""
        return self.samplers.collect(step, loss, replay)

    @property
    def fp8_overflow(self) -> tuple[str, float] | None:
        """The last FP8 sample's worst overflow ratio and its tensor (None before one)."""
        return self.samplers.fp8_overflow

    # ------------------------------------------------------------ per log interval

    def episode_active(self) -> bool:
        """Whether a spike episode is unrecovered on this rank (one host read: at saves)."""
        active = STAT_FIELDS.index("active")
        return any(bool(self.detectors[s].stats()[active].item()) for s in SIGNALS)

    def stats(self) -> torch.Tensor | None:
        """The detectors' device statistics, for the log interval's one sync (MAX over ranks);
        ``NoTelemetry``: None, there are none."""
        return self._stats()

    def _stats(self) -> torch.Tensor:
        return torch.cat([self.detectors[s].stats() for s in SIGNALS])

    def rebase(self) -> None:
        """Every detector takes the current level as its baseline (an expected change)."""
        for detector in self.detectors.values():
            detector.rebase()

    def publish(
        self, record: dict[str, Any], by_signal: SignalStats, tokens_local: float, elapsed: float
    ) -> None:
        """Export one log interval and add the telemetry fields to its metrics record;
        ``by_signal``: each signal's detector statistics by name, reduced over ranks."""
        metrics = self.metrics
        for signal, values in by_signal.items():
            metrics.set(f"{signal}_zscore", values["zscore"])
            metrics.set("nonfinite_step", values["nonfinite_step"], signal=signal)
            metrics.set("spike_active", values["active"], signal=signal)
            metrics.set("spike_duration_steps", values["duration"], signal=signal)
            self._export_total("spikes", values["spikes_total"], signal=signal)
            self._export_total("nonfinite", values["nonfinite_total"], signal=signal)
            record[f"{signal}_zscore"] = values["zscore"]
            record[f"{signal}_spike_active"] = bool(values["active"])
            record[f"{signal}_spikes_total"] = int(values["spikes_total"])
            record[f"{signal}_nonfinite_total"] = int(values["nonfinite_total"])
            record[f"{signal}_nonfinite_step"] = int(values["nonfinite_step"])
        for signal in LEVEL_SHIFT_SIGNALS:
            values = by_signal[signal]
            self._export_total("level_shifts", values["level_shifts_total"], signal=signal)
            metrics.set("level_shift_step", values["level_shift_step"], signal=signal)
            record[f"{signal}_level_shifts_total"] = int(values["level_shifts_total"])
        tokens_per_second = tokens_local / elapsed if elapsed > 0 else 0.0
        metrics.inc("tokens", tokens_local)
        metrics.set("tokens_per_second", tokens_per_second)
        flops = tokens_per_second * self.flops_per_token
        metrics.set("model_flops_per_second", flops)
        record["model_flops_per_second"] = flops * self.world_size
        if self.peak is not None:
            mfu = flops / self.peak.flops
            metrics.set("mfu_ratio", mfu)
            record["mfu"] = mfu
        self._export_total("skipped_steps", record["skipped_steps"], reason="nonfinite")
        self._export_total("skipped_steps", record["skipped_spikes"], reason="spike")
        for name in OPTIMIZER_COUNTERS:
            if name in record:
                self._export_total(name, record[name])
        for name in ("train_loss", "grad_norm"):
            if math.isfinite(record[name]):
                metrics.set(name, record[name])
        if record.get("lr") is not None:
            metrics.set("learning_rate", record["lr"])
        if record.get("loss_scale") is not None:
            metrics.set("amp_loss_scale", record["loss_scale"])
        self._publish_memory(record)

    def count_optimizer(self) -> None:
        """The optimizer keeps its own counters (SPAM): their series start at 0."""
        for name in OPTIMIZER_COUNTERS:
            self.metrics.child(name)

    def publish_eval(self, val_loss: float) -> None:
        if math.isfinite(val_loss):
            self.metrics.set("val_loss", val_loss)

    def resync_totals(self, step: int) -> SignalStats:
        """After a restore to ``step``: the detectors count steps from there and their totals
        jump back, so counters count on from them; the last non-finite and level-shift steps
        are the restored ones at once (an alert on the first resolves). One read of the
        statistics reduced over ranks, as every log interval reads them (the worst rank's):
        every rank's audit then compares the same totals and enters the same collectives.
        Returns them by signal."""
        for detector in self.detectors.values():
            detector.set_step(step)
        restored = all_reduce_max_tensor(
            self._stats(), "all_reduce: detector totals after a restore"
        )
        by_signal = signal_stats(restored.tolist())
        for signal, values in by_signal.items():
            self._exported_totals[_total_key("spikes", signal=signal)] = values["spikes_total"]
            self._exported_totals[_total_key("nonfinite", signal=signal)] = values[
                "nonfinite_total"
            ]
            self.metrics.set("nonfinite_step", values["nonfinite_step"], signal=signal)
        for signal in LEVEL_SHIFT_SIGNALS:
            values = by_signal[signal]
            key = _total_key("level_shifts", signal=signal)
            self._exported_totals[key] = values["level_shifts_total"]
            self.metrics.set("level_shift_step", values["level_shift_step"], signal=signal)
        return by_signal

    def _export_total(self, name: str, total: float, **labels: str) -> None:
        """Counters only go up: export the increase of a device-side running total."""
        key = _total_key(name, **labels)
        increase = total - self._exported_totals.get(key, 0.0)
        self._exported_totals[key] = total
        self.metrics.inc(name, increase, **labels)

    def _publish_memory(self, record: dict[str, Any]) -> None:
        memory = memory_stats(self.device)
        for kind in MEMORY_KINDS:
            if kind in memory:
                self.metrics.set("device_memory_bytes", memory[kind], kind=kind)
        if "limit" in memory:
            self.metrics.set("device_memory_limit_bytes", memory["limit"])
        for name, key in (("memory_alloc_retries", "alloc_retries"), ("oom", "ooms")):
            if key in memory:
                self._export_total(name, memory[key])
        record["memory"] = memory
        sample = self.nvml.sample()
        if sample is not None:
            self.metrics.set("gpu_utilization_ratio", sample["utilization_ratio"])
            self.metrics.set("gpu_power_watts", sample["power_watts"])
            self.metrics.set("gpu_temperature_celsius", sample["temperature_celsius"])
            record["gpu"] = sample

    # ------------------------------------------------------------ static, checkpoints, control

    def _publish_static(self, model: nn.Module, run_id: str) -> None:
        cfg = self.config
        self.metrics.set(
            "run_info",
            1,
            model=type(model).__name__,
            precision=cfg.precision.dtype,
            device=self.device.type,
            world_size=str(self.world_size),
            version=__version__,
            git_commit=git_commit() or "unknown",
        )
        if self.max_steps is not None:
            self.metrics.set("step_target", self.max_steps)
        self.metrics.set("paused", 0)
        self.metrics.set("checkpoint_in_progress", 0)
        for signal in SIGNALS:
            self.metrics.set("nonfinite_step", -1, signal=signal)
        for signal in LEVEL_SHIFT_SIGNALS:
            self.metrics.set("level_shift_step", -1, signal=signal)
        if self.peak is not None:
            self.metrics.set("peak_flops", self.peak.flops, source=self.peak.source)

    def announce(self, control: str | None) -> None:
        """Export ``agent_info`` with rank 0's advertised TCP control address (None: no TCP
        control, or another rank) and the supervisor's, from the environment it set."""
        self.metrics.clear("agent_info")
        self.metrics.set(
            "agent_info",
            1,
            host=socket.gethostname(),
            node=os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or "0",
            control=control or "",
            supervisor=os.environ.get(SUPERVISOR_CONTROL_ENV, ""),
            protocol=str(PROTOCOL_VERSION),
        )

    def checkpoint_started(self) -> None:
        self.metrics.set("checkpoint_in_progress", 1)

    def checkpoint_finished(self, seconds: float | None, named: NamedStates) -> None:
        """A save ended (``seconds`` None if it failed); ``named``: latest, best, last good."""
        self.metrics.set("checkpoint_in_progress", 0)
        if seconds is not None:
            self.metrics.observe("checkpoint_save_duration_seconds", seconds)
            self.metrics.set("checkpoint_timestamp_seconds", time.time())
        self.states_changed(named)

    def states_changed(self, named: NamedStates) -> None:
        """The steps of the latest, best and last good states, on disk or in memory (``named``
        finds them: it is called here, not where telemetry is off)."""
        for kind, meta in named().items():
            if meta is not None:
                self.metrics.set("checkpoint_step", meta.step, kind=kind)

    def snapshots(self, enabled: bool, held_bytes: int) -> None:
        """Whether in-memory snapshots are on, and the host memory they hold."""
        self.metrics.set("snapshots_enabled", int(enabled))
        self.metrics.set("snapshot_bytes", held_bytes)

    def command_applied(self, command: str, ok: bool) -> None:
        self.metrics.inc("control_commands", command=command, result="ok" if ok else "error")
        if ok and command == "rollback":
            self.metrics.inc("rollbacks")

    def control_refused(self, reason: str) -> None:
        self.metrics.inc("control_refusals", reason=reason)

    def paused(self, paused: bool) -> None:
        self.metrics.set("paused", int(paused))

    def close(self) -> None:
        self.exporter.stop()
        self.nvml.close()
