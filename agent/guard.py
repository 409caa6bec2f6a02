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
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lossguard.agent.checkpoint.cadence import Due
from lossguard.agent.checkpoint.formats import PROGRESS_STATE, Stateful
from lossguard.agent.config import GuardConfig
from lossguard.agent.control.commands import CommandRunner
from lossguard.agent.distributed import control_group, rank_and_world
from lossguard.agent.dtensors import full_value
from lossguard.agent.guard_controls import GuardControls
from lossguard.agent.recovery import TrainProgress
from lossguard.agent.restored import Restores
from lossguard.agent.resume_plan import ResumePlan
from lossguard.agent.run_context import RunContext
from lossguard.agent.run_records import RunRecords
from lossguard.agent.run_start import (
    detector_states,
    on_main,
    open_run,
    start_fields,
    start_over_check,
    start_recovery,
    start_telemetry,
)
from lossguard.agent.stop_signals import StopSignals, catching_from_the_start
from lossguard.agent.stuck_rank import StuckRankWatch
from lossguard.agent.telemetry.batch_tokens import BatchTokens, vocabulary_of
from lossguard.agent.telemetry.fp8_fidelity import Replay
from lossguard.agent.telemetry.hub import Telemetry
from lossguard.agent.telemetry.interval import Interval
from lossguard.agent.telemetry.log_interval import IntervalLog
from lossguard.agent.telemetry.lr_watch import lr_watch
from lossguard.agent.update_skips import UpdateSkips
from lossguard.common.control.protocol import Target
from lossguard.common.rundir.directory import RunDirectory
from lossguard.common.rundir.events import OVERWRITTEN, RESUMED, SIGNAL, START

log = logging.getLogger("lossguard.agent")


class Guard(GuardControls):
    """Accounting, gradient norm, metrics, checkpoints and control for a training loop.

    ``config`` is a ``GuardConfig`` (the built-in trainer's ``TrainerConfig`` is one): run,
    checkpoint, snapshot, mitigation, control, telemetry, wandb, distributed timeouts and
    ``train.log_every``; what the loop itself does is the caller's: ``max_steps`` (the
    planned last step: status, progress, the step target; None: open-ended) and ``grad_clip``
    (clip the gradient norm to it in ``after_backward``; None: measure it, never clip).

    Starting (``resume``, ``skip_batches``, ``overwrite``): as ``resume_plan.ResumePlan`` says; a
    resume target that cannot be restored raises RestoreError (the Guard is then closed).

    The stop signals (``stop_signals``) are caught from the start of ``__init__`` (taken over
    from ``lossguard-agent run``'s catcher); one that comes while the Guard starts is acted on
    at the first ``poll``. If ``__init__`` raises, the handlers from before are put back.
    """

    signals: StopSignals

    @catching_from_the_start
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
        config: GuardConfig | None = None,
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
        start = ResumePlan.of(resume, skip_batches, overwrite)
        self.config = config if config is not None else GuardConfig()
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
        self.preempted = False  # stopped by the preempt signal: the run is to be requeued
        self.started_at = time.time()
        self.last_train_loss: float | None = None
        self.last_val: tuple[int, float] | None = None  # (step, val_loss) of the last evaluation
        self._nonfinite_checkpoint_taken = False
        self.interval = Interval(self.device)

        self.path = Path(run_dir)
        self.run_id = self.config.run.id or self.path.name
        self.records = RunRecords()  # rank 0's, opened below
        self._stuck: StuckRankWatch | None = None
        group = control_group(self.config.distributed.timeout.seconds)
        ctx = RunContext(self.rank, self.world_size, group, self.device, self.run_id, self.event)
        moved = on_main(lambda: start_over_check(self.path, start), self.rank, group)
        telemetry = start_telemetry(
            self.config,
            model,
            ctx,
            max_steps=max_steps,
            flops_per_token=flops_per_token,
            loss_scaling=scaler is not None,
        )
        self.ctx = ctx = ctx.with_telemetry(telemetry)
        self.telemetry = telemetry if isinstance(telemetry, Telemetry) else None
        """The telemetry hub; None while ``telemetry.enabled`` is off."""
        self.state.update(detector_states(telemetry))
        self.log = IntervalLog(
            ctx,
            self.interval,
            optimizer=optimizer,
            scaler=scaler,
            state=self.state,
            fp16_unscaled=self.config.precision.dtype == "fp16" and scaler is None,
            lr_watch=lr_watch(optimizer, scheduler, lambda: self.step + 1),
            tokens=BatchTokens(self.device, vocabulary=vocabulary_of(model))
            if telemetry.enabled
            else None,
        )
        self._skips = UpdateSkips(ctx, self.config, optimizer=optimizer, scaler=scaler)
        self.log.start = (self.step, self.log.data_position())
        if ctx.main:
            run = RunDirectory(self.path, self.config.run.mode_bits)
            shown = (max_steps, self.step) if progress else None
            self.records = open_run(ctx, run, self.config, progress=shown)
        self.control, self.checkpoints = self.records.control, self.records.checkpoints
        self._due = Due(self.config, group)
        restores = Restores()
        self.recovery = start_recovery(
            ctx,
            self.config,
            self.state,
            self.progress,
            model=model,
            optimizer=optimizer,
            path=self.path,
            records=self.records,
            healthy_now=lambda: self.log.healthy(self.last_train_loss),
            restores=restores,
        )
        for listener in (
            self._restored,
            self.log.restored,
            self._skips.restored,
            self._due.restored,
        ):
            restores.subscribe(listener)
        self.commands = CommandRunner(
            self,
            ctx,
            control=self.control,
            store=self.checkpoints,
            snapshots=self.recovery.snapshots,
        )
        if ctx.main:
            self.event(START, **start_fields(self.control, self.world_size))
        if moved is not None:
            self.event(OVERWRITTEN, moved_to=str(moved[0]), checkpoints=moved[1])
        if start.target is not None:
            self._resume(start)
        self._before_next_step()
        # the state training starts from, at the first poll: after an evaluation there, so
        # that a rollback to it need not evaluate again
        self._due.snapshot = True
        if self.world_size > 1:
            self._stuck = StuckRankWatch(
                grace_s=self.config.distributed.stop_grace.seconds,
                stop_asked=self.records.stop_asked,
                signalled=self.signals.name,
            )

    def _resume(self, start: ResumePlan) -> None:
        """Restore ``start.target`` before the first step; audited and logged with its source.
        A failure closes the Guard and raises."""
        assert start.target is not None
        try:
            restored = self.restore(start.target, skip_batches=start.skip_batches)
        except BaseException:
            self.close(failed=True)
            raise
        self.event(RESUMED, **start.audit(), **restored)
        if self.rank == 0:
            start.log_resumed(restored)

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
            self.ctx.telemetry.exclude(spent)

    def register(self, name: str, obj: Stateful) -> None:
        """Add state that checkpoints save and rollbacks restore (anything with state_dict).
        Registered after a restore (a ``resume``) and before the next step, it gets the state
        the checkpoint holds under ``name``."""
        self.recovery.register(name, obj)

    def after_backward(
        self,
        loss: torch.Tensor,
        *,
        tokens: int,
        replay: Replay | None = None,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Record the step's loss and tokens; compute the gradient norm and clip to
        ``grad_clip`` if given. Returns the pre-clip norm as a device tensor; nothing is synced.

        ``inputs``: the step's input token ids (integer tensors; a sequence for several
        micro-batches), optional. Their statistics, on the device, let a diagnosis judge the
        step's batch against the run's data.

        ``replay``, for the FP8 fidelity check (``telemetry.fp8_fidelity``): a function that
        runs this step's forward and backward again, on the same batches, through the module
        it is given (the high-precision shadow), and returns the loss as passed here. It is
        called on check steps only, before clipping."""
        if self.recovery.snapshots is not None:  # the update below must wait for its copy
            self.recovery.snapshots.before_update()
        if self.scaler is not None and self.optimizer is not None:
            self.scaler.unscale_(self.optimizer)
        if inputs is not None and self.log.tokens is not None:
            self.log.tokens.observe(self.step + 1, inputs)
        # sampled steps only: FP8 health and fidelity, gradients
        for record in self.ctx.telemetry.collect_samples(self.step + 1, loss, replay):
            self.records.emit(record, display=False)
        if self.grad_clip is not None:
            norm = nn.utils.clip_grad_norm_(self._params, self.grad_clip, foreach=True)
        else:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = nn.utils.get_total_norm(grads, foreach=True)
        norm = full_value(norm.detach()).float()  # sharded: one reduction over the shards
        self._skips.after_step(loss, norm, self.interval)  # the detectors, and skipped updates
        self.interval.add(loss, norm, tokens)
        return norm

    def end_step(self) -> None:
        """Close the optimizer step; at each log interval, sync once and write the metrics."""
        self.progress.step += 1
        self.recovery.unclaimed.clear()  # the restored state was for the step before this one
        self.interval.step_done()
        self.ctx.telemetry.step_done(self.step)
        self._before_next_step()
        logged = self.step % self.log_every == 0 or self.step == self.max_steps
        if logged:
            self._log_interval()
        self._due.step_done(self.step, logged, self.recovery.last_saved_at)

    def poll(self) -> None:
        """At this step boundary: take the periodic checkpoint and snapshot (after any
        evaluation of this step, so they carry the val loss), then apply control commands and
        stop signals. While the run is paused this blocks, still serving commands, until
        resumed or stopped."""
        if self._due.save:
            self._due.save = False
            self.save("periodic")
        if self._due.snapshot:
            taken = self.recovery.take_snapshot(
                train_loss=self.last_train_loss, val_loss=self._val_now()
            )
            self._due.snapshot = not taken  # not yet: at the next boundary
        while True:
            with self.idle() if self.paused else contextlib.nullcontext():
                commands, signalled = self.commands.gather(
                    wait=self.paused, signalled=self.signals.kind
                )
            if signalled and not self.stop_requested:
                self.preempted = signalled == 2
                self.event(SIGNAL, signal=self.signals.name, preempted=self.preempted)
                self.commands.stop(reason="preempted" if self.preempted else "signal")
            for request, pending in commands:
                self.commands.apply(request, pending)
            if not self.paused or self.stop_requested:
                break
        self._before_next_step()  # a restore may have moved the step and the RNG states

    def _before_next_step(self) -> None:
        """Arm the samplers of the coming step (at each call that may come last before its
        forward: start, end_step, poll)."""
        self.ctx.telemetry.sampling(self.step + 1)

    def record_eval(self, val_loss: float, **extra: float) -> None:
        """Log a validation result (already reduced over ranks) at the current step."""
        self.last_val = (self.step, val_loss)
        self.ctx.telemetry.publish_eval(val_loss)
        record: dict[str, Any] = {
            "kind": "eval",
            "step": self.step,
            "time": time.time(),
            "val_loss": val_loss,
            "val_perplexity": math.exp(min(val_loss, 700.0)),
        }
        record.update(extra)
        self.records.emit(record)

    # ----------------------------------------------------------------- metrics

    def _log_interval(self) -> None:
        record = self.log.end(self.step, self.progress.tokens)
        if record is None:
            return
        self.progress.tokens = record["tokens"]
        self.last_train_loss = record["train_loss"]
        self.records.emit(record)
        if not math.isfinite(record["train_loss"]) and not self._nonfinite_checkpoint_taken:
            self._nonfinite_checkpoint_taken = True  # kept for post-mortem, marked unhealthy
            self.save("nonfinite", healthy=False)

    def finish(self) -> None:
        """Training ended normally: save the final state (``checkpoint.save_on_exit``; not
        while ``untrained``)."""
        saved = self.recovery.last_saved_step
        if self.config.checkpoint.save_on_exit and saved != self.step and not self.untrained:
            self.save("final", wait=True)

    def close(self, *, failed: bool = False) -> None:
        """Log the last partial interval, wait for saves, and release everything. After a
        failure nothing collective runs (the other ranks may be elsewhere)."""
        if not failed:
            self._log_interval()
        self.signals.uninstall()
        self.log.close()
        self.recovery.close(failed=failed)
        self.ctx.telemetry.close()
        outcome = "failed" if failed else self.outcome
        self.records.close(self.step, stop_requested=self.stop_requested, outcome=outcome)
        if self._stuck is not None:
            self._stuck.close()
            self._stuck = None

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
