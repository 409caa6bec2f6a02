"""Guard: the one instrumentation API, used alike by the built-in trainer and by user loops.

    guard = Guard(run_dir, model=model, optimizer=opt, scheduler=sched, data=loader, config=cfg,
                  max_steps=10_000, grad_clip=1.0, resume=None)
    for batch in ...:
        loss = ...; loss.backward()
        guard.after_backward(loss, tokens=n)   # grad norm (and clipping if asked), on device
        opt.step(); sched.step()
        guard.end_step()                       # counters; every log interval: one host sync
        guard.poll()                           # control commands, applied at this boundary
        if guard.stop_requested: break
    guard.finish()                             # final checkpoint; then guard.close()

Per-step values stay on the device; they are read once per log interval. Checkpoints cover
every registered state (``register``), the data position and all RNG states (``recovery``);
commands are applied by ``control.commands``; records go to the sinks in ``telemetry.sinks``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from lossguard.agent.checkpoint.cadence import periodic_save_due, snapshot_store
from lossguard.agent.checkpoint.meta import CHECKPOINT_DIR, CheckpointMeta, list_checkpoints
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.config import Config
from lossguard.agent.control.commands import CommandRunner
from lossguard.agent.control.server import (
    ControlServer,
    answered_before,
    serve_control,
    socket_is_live,
)
from lossguard.agent.distributed import broadcast_objects, control_group, rank_and_world
from lossguard.agent.mitigation import SpikeSkipper
from lossguard.agent.recovery import (
    DETECTOR_STATE,
    PROGRESS_STATE,
    OnSaved,
    Recovery,
    Stateful,
    TrainProgress,
)
from lossguard.agent.rundir import RunDirectory, package_versions, set_aside
from lossguard.agent.stop_signals import StopSignals
from lossguard.agent.telemetry.collector import (
    SignalStats,
    Telemetry,
    signal_stats,
    skips_on_device,
)
from lossguard.agent.telemetry.diagnosis import IntervalContext, diagnose
from lossguard.agent.telemetry.fp8_fidelity import Replay
from lossguard.agent.telemetry.hardware import device_description
from lossguard.agent.telemetry.interval import DetectionAudit, Interval, IntervalTotals
from lossguard.agent.telemetry.lr_watch import lr_watch
from lossguard.agent.telemetry.progress import make_progress
from lossguard.agent.telemetry.sinks import DisplaySink, MetricsLogSink, Sink, WandbSink
from lossguard.common.protocol import SOCKET_NAME, ErrorCode, SkipBatches, Target, parse_target
from lossguard.common.supervisor_file import RESUME_ENV

log = logging.getLogger("lossguard.agent")
T = TypeVar("T")

RESUME_ARGUMENT = "argument"
"""A resume's ``source`` when it came from the caller (``resume=``, ``--resume``)."""


def resume_target(resume: Target | str | None) -> tuple[Target | None, str | None]:
    """The checkpoint to resume from and where that came from: ``$LOSSGUARD_RESUME`` when set
    and not empty (a supervisor's restart, which knows the good checkpoint), else ``resume``
    (``RESUME_ARGUMENT``); (None, None) to start afresh. ValueError names a bad one."""
    from_env = os.environ.get(RESUME_ENV, "")
    value, source = (from_env, RESUME_ENV) if from_env else (resume, RESUME_ARGUMENT)
    if value is None:
        return None, None
    try:
        return parse_target(value), source
    except ValueError as exc:
        name = RESUME_ENV if source == RESUME_ENV else "resume"
        raise ValueError(f"{name}: {exc}") from None


class CheckpointsExist(FileExistsError):
    """A run directory that already has checkpoints, and neither a resume nor an overwrite."""

    def __init__(self, run_dir: Path, newest: str) -> None:
        super().__init__(
            f"{run_dir} already has checkpoints (newest: {newest}): pass resume='latest' "
            "(or a checkpoint name) to continue the run, or overwrite=True to start over"
        )
        self.run_dir = run_dir
        self.newest = newest

    def __reduce__(self) -> tuple[Any, ...]:  # broadcast to every rank under torchrun
        return type(self), (self.run_dir, self.newest)


class Guard:
    """Accounting, gradient norm, metrics, checkpoints and control for a training loop.

    ``config`` supplies the ``checkpoint``, ``control``, ``telemetry`` and ``wandb`` sections
    and ``train.log_every``; what the loop itself does is the caller's: ``max_steps`` (the
    planned last step: status, progress, the step target; None: open-ended) and ``grad_clip``
    (clip the gradient norm to it in ``after_backward``; None: measure it, never clip).

    Starting: a run directory without checkpoints is started in (a run that crashed before
    its first checkpoint starts again). One with checkpoints is refused (``CheckpointsExist``)
    unless ``resume`` or ``overwrite`` says what to do:

    - ``resume``: a target (``latest``, ``last_good``, ``best``, a step, a checkpoint name such
      as ``step_00000150``) restored here, on every rank, before the first step; then
      ``skip_batches`` batches are passed over. ``$LOSSGUARD_RESUME``, set by the supervisor for
      a restart, wins over ``resume``, ``skip_batches`` and ``overwrite``. A ``resumed`` event
      records the target, where it came from and what was restored; a target that cannot be
      restored raises RestoreError (the Guard is then closed).
    - ``overwrite=True``: start over from step 0. The previous run's checkpoints, metrics and
      events, config and environment records are moved, not deleted, into
      ``run_dir/overwritten-<time>/`` (an ``overwritten`` event says where); refused while
      another agent serves the run directory's control socket.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        data: Stateful | None = None,
        scaler: torch.amp.GradScaler | None = None,
        ema: Stateful | None = None,
        config: Config | None = None,
        max_steps: int | None = None,
        grad_clip: float | None = None,
        resume: Target | str | None = None,
        skip_batches: int = 0,
        overwrite: bool = False,
        progress: bool = True,
        flops_per_token: float | None = None,
    ) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps: must be >= 1 or None, not {max_steps}")
        if grad_clip is not None and not (math.isfinite(grad_clip) and grad_clip > 0):
            raise ValueError(f"grad_clip: must be a number > 0 or None, not {grad_clip}")
        target, source = resume_target(resume)
        if source == RESUME_ENV:
            skip_batches, overwrite = 0, False  # the supervisor's restart: its checkpoint as is
        if target is not None and overwrite:
            raise ValueError("resume and overwrite=True exclude each other")
        if skip_batches < 0 or (skip_batches and target is None):
            raise ValueError(
                f"skip_batches: must be >= 0, and only with resume, not {skip_batches}"
            )
        self.config = config if config is not None else Config()
        self.max_steps = max_steps
        self.log_every = self.config.train.log_every
        self.grad_clip = grad_clip
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.progress = TrainProgress()
        self.state: dict[str, Stateful] = {"model": model}
        extra = {"optimizer": optimizer, "scheduler": scheduler, "data": data}
        extra.update(scaler=scaler, ema=ema)
        self.state.update({k: v for k, v in extra.items() if v is not None})
        self.state[PROGRESS_STATE] = self.progress
        self.rank, self.world_size = rank_and_world()
        self.device = next(model.parameters()).device
        self._params = [p for p in model.parameters() if p.requires_grad]

        self.paused = False
        self._stop = False
        self.started_at = time.time()
        self.last_train_loss: float | None = None
        self.last_val: tuple[int, float] | None = None  # (step, val_loss) of the last evaluation
        self._save_due = False
        self._logged_healthy: bool | None = True  # as of the last log interval (None: unknown)
        self._nonfinite_checkpoint_taken = False
        self.signals = StopSignals()
        self.interval = Interval(self.device)
        self._detections = DetectionAudit()
        self.episode: dict[str, Any] | None = None
        """The diagnosis of the latest spike episode or non-finite value since the last restore
        (``telemetry.diagnosis``): the ``status`` command's ``episode``."""
        self._lr_before: float | None = None  # at the end of the last log interval
        self._loss_scale_before: float | None = None
        self._fp8_before: float | None = None  # worst FP8 overflow ratio at the last interval
        self._lr_watch = lr_watch(optimizer, scheduler, lambda: self.step + 1)
        self._interval_start: tuple[int, int | None] = (0, None)  # (step, data position)

        self.path = Path(run_dir)
        self.run_id = self.config.run.id or self.path.name
        self.run_dir: RunDirectory | None = None
        self.checkpoints: CheckpointStore | None = None
        self.control: ControlServer | None = None
        self.sinks: list[Sink] = []
        self._group = control_group()
        moved = self._on_main(
            lambda: self._start_over_check(resuming=target is not None, overwrite=overwrite)
        )
        self.telemetry: Telemetry | None = None
        self._can_skip = skips_on_device(optimizer, scaler)
        if self.config.telemetry.enabled:
            self.telemetry = Telemetry(
                self.config,
                model=model,
                device=self.device,
                rank=self.rank,
                world_size=self.world_size,
                run_id=self.run_id,
                max_steps=max_steps,
                flops_per_token=flops_per_token or 6.0 * sum(p.numel() for p in self._params),
                group=self._group,
                loss_scaling=scaler is not None,
            )
            for signal_name, detector in self.telemetry.detectors.items():
                self.state[f"{DETECTOR_STATE}{signal_name}"] = detector
        self._skipper = self._spike_skipper()
        self._interval_start = (self.step, self._data_position())
        if self.rank == 0:
            self._open_run_directory(progress)
        self._snapshot_due = False
        self.recovery = Recovery(
            self.state,
            self.progress,
            store=self.checkpoints,
            snapshots=snapshot_store(self.config.snapshot),
            group=self._group,
            rank=self.rank,
            world_size=self.world_size,
            async_save=self.config.checkpoint.async_save,
            telemetry=self.telemetry,
            healthy_now=self._healthy_now,
            on_restored=self._restored,
            event=self.event,
        )
        self.commands = CommandRunner(
            self,
            control=self.control,
            store=self.checkpoints,
            snapshots=self.recovery.snapshots,
            telemetry=self.telemetry,
            group=self._group,
            rank=self.rank,
            world_size=self.world_size,
        )
        if self.rank == 0:
            self.event(
                "start",
                pid=os.getpid(),
                world_size=self.world_size,
                control_socket=str(self.control.socket_path) if self.control else None,
                control_tcp=self.control.tcp_address if self.control else None,
            )
        if moved is not None:
            self.event("overwritten", moved_to=str(moved[0]), checkpoints=moved[1])
        self.signals.install()
        if target is not None:
            self._resume(target, skip_batches, str(source))
        self._before_next_step()
        # the state training starts from, at the first poll: after an evaluation there, so
        # that a rollback to it need not evaluate again
        self._snapshot_due = True

    def _spike_skipper(self) -> SpikeSkipper | None:
        """Rung 1 (``mitigation.skip_spikes``), where this loop can skip on the device."""
        if not self.config.mitigation.skip_spikes:
            return None
        if self.telemetry is None or not self._can_skip:
            log.warning(
                "mitigation.skip_spikes is off for this run: skipping an update on the device "
                "needs telemetry, a fused optimizer and no GradScaler"
            )
            return None
        distributed = self.world_size > 1
        return SpikeSkipper(self.config.mitigation, self.device, distributed=distributed)

    def _on_main(self, work: Callable[[], T]) -> T:
        """Run ``work`` on rank 0; every rank returns its result or raises its exception."""
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome = [(work(), None)]
            except Exception as exc:
                outcome = [(None, exc)]
        result, error = broadcast_objects(outcome, self._group)[0]
        if error is not None:
            raise error
        return result

    def _start_over_check(
        self, *, resuming: bool, overwrite: bool
    ) -> tuple[Path, list[str]] | None:
        """Before anything is written: refuse to start afresh over checkpoints, or move the
        previous run aside (``overwrite``); returns where to and which checkpoints."""
        existing = list_checkpoints(self.path / CHECKPOINT_DIR)
        if resuming or not existing:
            return None
        if not overwrite:
            raise CheckpointsExist(self.path, existing[-1].name)
        if socket_is_live(self.path / SOCKET_NAME):
            raise FileExistsError(
                f"{self.path} is still running (its control socket answers): not overwriting it"
            )
        aside = set_aside(self.path)
        assert aside is not None  # there were checkpoints to move
        names = [meta.name for meta in existing]
        log.warning(
            "overwrite: moved the previous run in %s (%d checkpoints, newest %s) to %s",
            self.path,
            len(names),
            names[-1],
            aside,
        )
        return aside, names

    def _resume(self, target: Target, skip_batches: int, source: str) -> None:
        """Restore ``target`` before the first step; audited and logged with its source. A
        failure closes the Guard and raises."""
        try:
            restored = self.restore(target, skip_batches=skip_batches)
        except BaseException:
            self.close(failed=True)
            raise
        self.event(
            "resumed", target=target, source=source, skipped_batches=skip_batches, **restored
        )
        if self.rank == 0:
            log.info(
                "resumed from %s at step %d (target %s from %s)",
                restored["checkpoint"],
                restored["step"],
                target,
                "$" + RESUME_ENV if source == RESUME_ENV else "the resume argument",
            )

    def _open_run_directory(self, progress: bool) -> None:
        """Rank 0: the run directory, the control server, the sinks and ``agent.json``."""
        continuing = (self.path / "config.yaml").exists()
        self.run_dir = RunDirectory(self.path)
        # these fail before any file is written
        self.control = serve_control(
            self.config.control,
            self.path,
            self._record_rejected,
            answered=answered_before(self.run_dir.read_events()),
        )
        self.sinks.append(MetricsLogSink(self.run_dir.metrics))
        if self.config.wandb.enabled:
            from lossguard.agent.telemetry.wandb_logger import WandbLogger

            wandb = WandbLogger(
                self.config.wandb,
                run_id=self.run_id,
                run_dir=self.path,
                config=self.config.resolved(),
                resume=continuing,
            )
            self.sinks.append(WandbSink(wandb))
        self.run_dir.write_config(self.config.resolved())
        self.run_dir.write_env(device_description(self.device), self.world_size)
        self.checkpoints = CheckpointStore(
            self.path / CHECKPOINT_DIR,
            keep_last=self.config.checkpoint.keep_last,
            config_hash=self.config.digest(),
            versions=package_versions(),
        )
        self.run_dir.write_discovery(
            run_id=self.run_id,
            socket_path=self.control.socket_path if self.control else None,
            metrics_urls=self.telemetry.urls if self.telemetry else [],
            world_size=self.world_size,
        )
        if progress:
            self.sinks.append(DisplaySink(make_progress(self.max_steps, self.step)))

    # ----------------------------------------------------------------- where training stands

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.progress.step

    @property
    def tokens_total(self) -> int:
        """Tokens trained on, all ranks, as of the last log interval."""
        return self.progress.tokens

    @property
    def lr_scale(self) -> float:
        return self.progress.lr_scale

    @property
    def stop_requested(self) -> bool:
        """The loop should end: stopped by a command or signal, or a restore failed halfway
        (its state is a mix of two checkpoints and must not train on)."""
        return self._stop or self.recovery.state_mixed

    @stop_requested.setter
    def stop_requested(self, stop: bool) -> None:
        self._stop = stop

    # ----------------------------------------------------------------- the per-step API

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Time spent inside is not training (evaluation, a pause): it stays out of step
        times, tokens/s and MFU."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.interval.exclude(spent)
            if self.telemetry is not None:
                self.telemetry.exclude(spent)

    def register(self, name: str, obj: Stateful) -> None:
        """Add state that checkpoints save and rollbacks restore (anything with state_dict).
        Registered after a restore (a ``resume``) and before the next step, it gets the state
        the checkpoint holds under ``name``."""
        if name in self.state:
            raise ValueError(f"state {name!r} is already registered")
        self.state[name] = obj
        saved = self.recovery.unclaimed.pop(name, None)
        if saved is not None:
            obj.load_state_dict(saved)

    def after_backward(
        self, loss: torch.Tensor, *, tokens: int, replay: Replay | None = None
    ) -> torch.Tensor:
        """Record the step's loss and tokens; compute the gradient norm and clip to
        ``grad_clip`` if given. Returns the pre-clip norm as a device tensor; nothing is synced.

        ``replay``, for the FP8 fidelity check (``telemetry.fp8_fidelity``): a function that
        runs this step's forward and backward again, on the same batches, through the module
        it is given (the high-precision shadow), and returns the loss as passed here. It is
        called on check steps only, before clipping."""
        if self.recovery.snapshots is not None:  # the update below must wait for its copy
            self.recovery.snapshots.before_update()
        if self.scaler is not None and self.optimizer is not None:
            self.scaler.unscale_(self.optimizer)
        if self.telemetry is not None:  # sampled steps only: FP8 health and fidelity, gradients
            for record in self.telemetry.collect_samples(self.step + 1, loss, replay):
                self._emit(record, display=False)
        if self.grad_clip is not None:
            norm = nn.utils.clip_grad_norm_(self._params, self.grad_clip, foreach=True)
        else:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = nn.utils.get_total_norm(grads, foreach=True)
        norm = norm.detach().float()
        if self.telemetry is not None:
            # Skip on the grad norm only: it is the same on every rank after DDP's all-reduce,
            # so every replica skips the same steps (a rank's own loss is counted, not acted on).
            norm_bad = self.telemetry.on_step(loss, norm)
            if self.scaler is not None:
                self.interval.skipped += norm_bad  # the GradScaler skips these steps itself
            elif self._can_skip and (self.config.telemetry.skip_nonfinite or self._skipper):
                skip = norm_bad if self.config.telemetry.skip_nonfinite else norm_bad & False
                self.interval.skipped += skip
                if self._skipper is not None:  # rung 1: a spike's update is skipped too
                    spike = self._skipper.flag(self.telemetry.detectors) & ~skip
                    self.interval.skipped_spikes += spike
                    skip = skip | spike
                self.optimizer.found_inf = skip.float()  # type: ignore[union-attr]
        self.interval.add(loss, norm, tokens)
        return norm

    def end_step(self) -> None:
        """Close the optimizer step; at each log interval, sync once and write the metrics."""
        self.progress.step += 1
        self.recovery.unclaimed.clear()  # the restored state was for the step before this one
        self.interval.step_done()
        if self.telemetry is not None:
            self.telemetry.step_done(self.step)
        self._before_next_step()
        logged = self.step % self.log_every == 0 or self.step == self.max_steps
        if logged:
            self._log_interval()
        self._save_due = periodic_save_due(
            self.config.checkpoint, self.step, logged, self.recovery.last_saved_at, self._group
        )
        every = self.config.snapshot.every
        self._snapshot_due = every is not None and self.step % every == 0

    def poll(self) -> None:
        """At this step boundary: take the periodic checkpoint and snapshot (after any
        evaluation of this step, so they carry the val loss), then apply control commands and
        stop signals. While the run is paused this blocks, still serving commands, until
        resumed or stopped."""
        if self._save_due:
            self._save_due = False
            self.save("periodic")
        if self._snapshot_due:
            self._snapshot_due = False
            self._take_snapshot()
        while True:
            with self.idle() if self.paused else contextlib.nullcontext():
                commands, signalled = self.commands.gather(
                    wait=self.paused, signalled=self.signals.pending
                )
            if signalled and not self.stop_requested:
                self.event("signal", signal=self.signals.name)
                self.commands.stop(reason="signal")
            for request, pending in commands:
                self.commands.apply(request, pending)
            if not self.paused or self.stop_requested:
                break
        self._before_next_step()  # a restore may have moved the step and the RNG states

    def _before_next_step(self) -> None:
        """Arm the samplers of the coming step (at each call that may come last before its
        forward: start, end_step, poll)."""
        if self.telemetry is not None:
            self.telemetry.sampling(self.step + 1)

    def record_eval(self, val_loss: float, **extra: float) -> None:
        """Log a validation result (already reduced over ranks) at the current step."""
        self.last_val = (self.step, val_loss)
        if self.telemetry is not None:
            self.telemetry.publish_eval(val_loss)
        record: dict[str, Any] = {
            "kind": "eval",
            "step": self.step,
            "time": time.time(),
            "val_loss": val_loss,
            "val_perplexity": math.exp(min(val_loss, 700.0)),
        }
        record.update(extra)
        self._emit(record)

    # ----------------------------------------------------------------- metrics

    def _log_interval(self) -> None:
        if self.interval.steps == 0:
            return
        stats = self.telemetry.stats() if self.telemetry is not None else None
        totals = self.interval.read(stats)  # the one sync
        self.progress.tokens += int(totals.tokens)
        self.last_train_loss = totals.loss_sum / (totals.steps * self.world_size)
        elapsed = totals.elapsed
        record: dict[str, Any] = {
            "kind": "train",
            "step": self.step,
            "time": time.time(),
            "train_loss": self.last_train_loss,
            "grad_norm": totals.grad_norm_last / self.world_size,
            "grad_norm_max": totals.grad_norm_max / self.world_size,
            "lr": self.learning_rate(),
            "tokens": self.tokens_total,
            "tokens_per_second": totals.tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_seconds": elapsed / totals.steps,
        }
        position = self._data_position()
        if position is not None:
            record["data_position"] = position
        if self.scaler is not None:
            record["loss_scale"] = float(self.scaler.get_scale())
        record["skipped_steps"] = int(totals.skipped / self.world_size)
        record["skipped_spikes"] = int(totals.skipped_spikes / self.world_size)
        by_signal: SignalStats | None = None
        if self.telemetry is not None:
            by_signal = self.telemetry.publish(
                record, totals.stats, float(totals.local_tokens), elapsed
            )
            self._audit(by_signal, totals)
        active = by_signal is not None and any(s["active"] for s in by_signal.values())
        self._logged_healthy = math.isfinite(self.last_train_loss) and not active
        self._emit(record)
        self.interval.reset()
        self._lr_before = record["lr"]
        self._loss_scale_before = record.get("loss_scale")
        if self.telemetry is not None and self.telemetry.fp8_overflow is not None:
            self._fp8_before = self.telemetry.fp8_overflow[1]
        self._interval_start = (self.step, position)
        if not math.isfinite(totals.loss_sum) and not self._nonfinite_checkpoint_taken:
            self._nonfinite_checkpoint_taken = True  # kept for post-mortem, marked unhealthy
            self.save("nonfinite", healthy=False)

    def _audit(self, stats: SignalStats, totals: IntervalTotals) -> None:
        """Audit the spike episodes and non-finite values new since the last read, each with
        its diagnosis; the most telling one of them becomes ``episode``."""
        found = self._detections.new(stats)
        if not found or self.telemetry is None:
            return
        context = self._context(totals)
        candidates = []
        for event, fields in found:
            signal_name, nonfinite = fields["signal"], event == "nonfinite"
            diagnosis = diagnose(signal_name, nonfinite=nonfinite, stats=stats, context=context)
            self.event(event, **fields, diagnosis=diagnosis)
            if nonfinite and not self.telemetry.detectors[signal_name].nonfinite_opens_episode:
                continue  # routine (fp16 GradScaler overflow): no episode
            rank = (diagnosis["step"], nonfinite, signal_name == "loss")
            candidates.append((rank, diagnosis))
        if candidates:
            self.episode = max(candidates, key=lambda item: item[0])[1]

    def _context(self, totals: IntervalTotals) -> IntervalContext:
        """What a diagnosis needs beside the detector statistics (at detections only: the
        loss scale is one more host read)."""
        grad_norm_max = totals.grad_norm_max / self.world_size
        fp8 = self.telemetry.fp8_overflow if self.telemetry is not None else None
        departure = self._lr_watch.departure if self._lr_watch is not None else None
        start_step, start_position = self._interval_start
        return IntervalContext(
            step=self.step,
            lr=self.learning_rate(),
            lr_before=self._lr_before,
            loss_scale=float(self.scaler.get_scale()) if self.scaler is not None else None,
            loss_scale_before=self._loss_scale_before,
            fp16_unscaled=self.config.precision.dtype == "fp16" and self.scaler is None,
            grad_norm_max=grad_norm_max if math.isfinite(grad_norm_max) else None,
            fp8_overflow=fp8,
            fp8_overflow_before=self._fp8_before,
            scheduled=self._lr_watch is not None,
            lr_departure=astuple(departure) if departure is not None else None,
            start_step=start_step,
            start_position=start_position,
            end_position=self._data_position(),
        )

    def _data_position(self) -> int | None:
        position = getattr(self.state.get("data"), "position", None)
        return None if position is None else int(position)

    def learning_rate(self) -> float | None:
        if self.optimizer is None:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def _emit(self, record: dict[str, Any], *, display: bool = True) -> None:
        for sink in self.sinks:
            sink.write(record, display=display)

    def event(self, kind: str, /, **fields: Any) -> None:
        """Append to the audit trail, events.jsonl (rank 0)."""
        if self.run_dir is not None:
            record = {"time": time.time(), "step": self.step, "event": kind, **fields}
            self.run_dir.events.append(record)

    # ----------------------------------------------------------------- checkpoints and control

    def status(self) -> dict[str, Any]:
        """Where training stands, as the ``status`` command answers it."""
        return {
            "run_id": self.run_id,
            "step": self.step,
            "max_steps": self.max_steps,
            "tokens": self.tokens_total,
            "paused": self.paused,
            "stopping": self.stop_requested,
            "lr": self.learning_rate(),
            "lr_scale": self.lr_scale,
            "last_train_loss": self.last_train_loss,
            "last_val_loss": self.last_val[1] if self.last_val else None,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "uptime_seconds": time.time() - self.started_at,
            "episode": self.episode,
        }

    def _healthy_now(self) -> bool:
        """This rank: false inside a spike episode, or when the current interval or the last
        logged one saw a non-finite loss (DESIGN.md ``last_good``). Right after a log interval
        (no step since) that interval's reading answers, with no host read."""
        if self.interval.steps == 0 and self._logged_healthy is not None:
            return self._logged_healthy
        interval_finite = self.interval.finite()
        last = self.last_train_loss
        in_episode = self.telemetry is not None and self.telemetry.episode_active()
        return interval_finite and (last is None or math.isfinite(last)) and not in_episode

    def save(
        self,
        reason: str = "manual",
        *,
        healthy: bool | None = None,
        wait: bool = False,
        on_done: OnSaved | None = None,
    ) -> None:
        """Checkpoint now (rank 0 writes). Async unless ``checkpoint.async`` is off or ``wait``;
        ``on_done`` gets the meta or the error once the checkpoint is on disk."""
        val = self.last_val[1] if self.last_val and self.last_val[0] == self.step else None
        self.recovery.save(
            reason,
            healthy=healthy,
            train_loss=self.last_train_loss,
            val_loss=val,
            wait=wait,
            on_done=on_done,
        )

    def _take_snapshot(self) -> None:
        val = self.last_val[1] if self.last_val and self.last_val[0] == self.step else None
        self.recovery.take_snapshot(train_loss=self.last_train_loss, val_loss=val)

    def restore(self, target: Target, *, skip_batches: SkipBatches = 0) -> dict[str, Any]:
        """Load a checkpoint into every registered state on every rank; then skip batches.
        Returns what was restored: checkpoint name and step. A checkpoint that cannot be
        loaded raises RestoreError and changes nothing; one that fails halfway through being
        applied stops training (its state would be a mix)."""
        meta = self.recovery.restore(target, skip_batches=skip_batches)
        self._interval_restarts()
        return {"checkpoint": meta.name, "step": self.step}

    def rollback(
        self, target: Target, *, skip_batches: SkipBatches, lr_scale: float
    ) -> dict[str, Any]:
        """Restore ``target``, skip batches (``"abandoned"``: those the abandoned steps trained
        on) and scale the learning rate (``rollback`` command). The answer's ``abandoned`` is
        the diagnosis of the latest spike or non-finite value of the abandoned steps, or None."""
        self._catch_up()
        result = self.recovery.rollback(
            target,
            skip_batches=skip_batches,
            lr_scale=lr_scale,
            episode=self.episode,
            trouble_since=self._episode_start(),
        )
        self._interval_restarts()
        return result

    def _episode_start(self) -> int | None:
        """The first step of the earliest spike episode still open on this rank (None: none
        is). One host read, at a rollback only."""
        if self.telemetry is None:
            return None
        starts = [
            self.step - int(s["duration"]) + 1
            for s in signal_stats(self.telemetry.stats().tolist()).values()
            if s["active"]
        ]
        return min(starts, default=None)

    def _catch_up(self) -> None:
        """Before a rollback: audit what the detectors saw since the last log interval (one
        collective read), so the steps about to be abandoned have their diagnosis."""
        if self.telemetry is None or self.interval.steps == 0:
            return
        totals = self.interval.read(self.telemetry.stats())
        self._audit(signal_stats(totals.stats), totals)

    def _interval_restarts(self) -> None:
        """After a restore (and its skipped batches, and a new lr scale): diagnoses compare
        with the state training goes on from."""
        self._lr_before = self.learning_rate()
        self._loss_scale_before = (
            float(self.scaler.get_scale()) if self.scaler is not None else None
        )
        self._interval_start = (self.step, self._data_position())

    def _restored(self, meta: CheckpointMeta) -> None:
        """After a restore: this boundary's bookkeeping is the checkpoint's."""
        self.last_train_loss = meta.train_loss
        self.last_val = (meta.step, meta.val_loss) if meta.val_loss is not None else None
        self._nonfinite_checkpoint_taken = False  # a new divergence gets its own post-mortem
        self._save_due = self._snapshot_due = False
        self._logged_healthy = None
        if self._skipper is not None:
            self._skipper.reset()
        if self._lr_watch is not None:
            self._lr_watch.reset()
        self.interval.reset()
        self.episode = None  # a new timeline: what was seen after this step did not happen
        if self.telemetry is not None:  # counters count on from the restored totals
            self._detections.resync(self.telemetry.resync_totals(self.step))

    def set_paused(self, paused: bool) -> None:
        """Pause or resume at this boundary (every rank, so every rank's gauge says so)."""
        self.paused = paused
        if self.telemetry is not None:
            self.telemetry.paused(paused)

    def set_lr_scale(self, scale: float) -> None:
        """Multiply the learning rate by ``scale`` relative to the schedule, from now on."""
        self.recovery.set_lr_scale(scale)

    def finish(self) -> None:
        """Training ended normally: save the final state (``checkpoint.save_on_exit``)."""
        saved = self.recovery.last_saved_step
        if self.config.checkpoint.save_on_exit and saved != self.step:
            self.save("final", wait=True)

    def _record_rejected(self, request_id: str | None, code: ErrorCode, message: str) -> None:
        if request_id is not None:  # a command we could identify; garbage lines are not events
            self.event(
                "command", id=request_id, ok=False, error={"code": code.value, "message": message}
            )

    def close(self, *, failed: bool = False) -> None:
        """Log the last partial interval, wait for saves, and release everything. After a
        failure nothing collective runs (the other ranks may be elsewhere)."""
        if not failed:
            self._log_interval()
        self.signals.uninstall()
        if self._lr_watch is not None:
            self._lr_watch.close()
        if self.checkpoints is not None:
            self.checkpoints.wait()
        if self.control is not None:
            self.control.close()
        if self.telemetry is not None:
            self.telemetry.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.run_dir is not None:
            self.event("close", stop_requested=self.stop_requested)
            self.run_dir.mark_finished(
                "failed" if failed else "stopped" if self.stop_requested else "completed"
            )
            self.run_dir.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finish()
        self.close(failed=exc_type is not None)
