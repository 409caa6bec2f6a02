"""GuardControls: where a Guard's training stands and what acts on it between steps (the
control commands, ``control.commands.Controllable``, and the loop's own calls): status, saves,
restores and rollbacks, pause, the learning-rate scale, an expected change, the audit trail.
``guard.Guard`` builds the parts they act through."""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from lossguard.agent.checkpoint.formats import OnSaved
from lossguard.agent.recovery import Recovery, TrainProgress
from lossguard.agent.restored import Restored
from lossguard.agent.run_context import RunContext
from lossguard.agent.run_records import RunRecords
from lossguard.agent.telemetry.log_interval import IntervalLog
from lossguard.common.control.protocol import SkipBatches, Target, check_reason
from lossguard.common.exitcodes import EXIT_CODES, EXIT_RETRYABLE


class GuardControls:
    """The Guard's state between steps and the calls that change it."""

    ctx: RunContext
    progress: TrainProgress
    recovery: Recovery
    log: IntervalLog
    records: RunRecords
    run_id: str
    max_steps: int | None
    world_size: int
    started_at: float
    paused: bool
    preempted: bool  # stopped by the preempt signal: the run is to be requeued
    _stop: bool
    last_train_loss: float | None
    last_val: tuple[int, float] | None  # (step, val_loss) of the last evaluation
    _nonfinite_checkpoint_taken: bool

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
    def untrained(self) -> bool:
        """At step 0 of a run started afresh, with nothing saved or restored: the model is as
        initialised. A stop or the end of the loop saves no checkpoint then: it would hold no
        training, and without one a restart, a requeue or a rerun starts afresh again."""
        return self.step == 0 and self.recovery.last_saved_step is None

    @property
    def stop_requested(self) -> bool:
        """The loop should end: stopped by a command or signal, or a restore failed halfway
        (its state is a mix of two checkpoints and must not train on)."""
        return self._stop or self.recovery.state_mixed

    @stop_requested.setter
    def stop_requested(self, stop: bool) -> None:
        self._stop = stop

    @property
    def outcome(self) -> Literal["completed", "stopped", "preempted"]:
        """How the run ends if it ends now without an error: completed, stopped (a ``stop``
        command or SIGTERM/SIGINT) or preempted (SIGUSR1, state saved: requeue it)."""
        if self.preempted:
            return "preempted"
        return "stopped" if self.stop_requested else "completed"

    def exit_code(self, *, failed: bool = False) -> int:
        """The process exit code for how the run ended (``lossguard.common.exitcodes``):
        ``sys.exit(guard.exit_code())`` after the loop, ``exit_code(failed=True)`` when it
        raised (a retryable failure)."""
        return EXIT_RETRYABLE if failed else EXIT_CODES[self.outcome]

    def learning_rate(self) -> float | None:
        return self.log.learning_rate()

    def event(self, kind: str, /, **fields: Any) -> None:
        """Append to the audit trail, events.jsonl (rank 0)."""
        self.records.event(self.step, kind, fields)

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
            "episode": self.log.episode,
        }

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
        self.recovery.save(
            reason,
            healthy=healthy,
            train_loss=self.last_train_loss,
            val_loss=self._val_now(),
            wait=wait,
            on_done=on_done,
        )

    def _val_now(self) -> float | None:
        """The val loss of this step's evaluation, if there was one."""
        return self.last_val[1] if self.last_val and self.last_val[0] == self.step else None

    def restore(self, target: Target, *, skip_batches: SkipBatches = 0) -> dict[str, Any]:
        """Load a checkpoint into every registered state on every rank; then skip batches.
        Returns what was restored: checkpoint name and step. A checkpoint that cannot be
        loaded raises RestoreError and changes nothing; one that fails halfway through being
        applied stops training (its state would be a mix)."""
        meta = self.recovery.restore(target, skip_batches=skip_batches)
        return {"checkpoint": meta.name, "step": self.step}

    def rollback(
        self, target: Target, *, skip_batches: SkipBatches, lr_scale: float
    ) -> dict[str, Any]:
        """Restore ``target``, skip batches (``"abandoned"``: those the abandoned steps trained
        on) and scale the learning rate (``rollback`` command). The answer's ``abandoned`` is
        the diagnosis of the latest spike or non-finite value of the abandoned steps, or None."""
        episode, trouble_since = self.log.before_rollback(self.step)
        return self.recovery.rollback(
            target,
            skip_batches=skip_batches,
            lr_scale=lr_scale,
            episode=episode,
            trouble_since=trouble_since,
        )

    def _restored(self, restored: Restored) -> None:
        """After a restore: this boundary's bookkeeping is the checkpoint's."""
        meta = restored.meta
        self.last_train_loss = meta.train_loss
        self.last_val = (meta.step, meta.val_loss) if meta.val_loss is not None else None
        self._nonfinite_checkpoint_taken = False  # a new divergence gets its own post-mortem

    def set_paused(self, paused: bool) -> None:
        """Pause or resume at this boundary (every rank, so every rank's gauge says so)."""
        self.paused = paused
        self.ctx.telemetry.paused(paused)

    def set_lr_scale(self, scale: float) -> None:
        """Multiply the learning rate by ``scale`` relative to the schedule, from now on."""
        self.recovery.set_lr_scale(scale)

    def expect_change(self, reason: str = "", *, request_id: str | None = None) -> dict[str, Any]:
        """The loss is expected to change level from here (a planned data-mix change): the
        spike detectors take the current level as their baseline (windows emptied, episodes
        ended) and an ``expected_change`` event is written. Under torchrun, call it on every
        rank at the same step. ``reason``: printable, at most 200 characters (ValueError
        otherwise); ``request_id``: the control command's, when one asked. Returns
        ``{"step": N}``, the step it applies after."""
        return self.log.expect_change(self.step, check_reason(reason), request_id)
