"""What the framework callbacks share: a Guard that a framework's loop drives.

A callback sees a step in pieces: each micro-batch's loss and tokens, then the moment before
the optimizer step (gradients complete), then the end of the step. ``FrameworkRun`` turns those
into Guard's per-step calls (``after_backward``, ``end_step``, ``poll``), so the numbers,
detectors, checkpoints and control commands are Guard's own. Nothing here reads a tensor to the
host: the loss stays on the device until Guard's log interval.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lossguard.agent.checkpoint.formats import OnSaved, RestoreError, Stateful
from lossguard.agent.config import GuardConfig
from lossguard.agent.guard import Guard
from lossguard.common.control.protocol import ABANDONED, SkipBatches, Target
from lossguard.common.rundir.events import CONTINUED
from lossguard.common.rundir.supervisor_file import RESUME_ENV

log = logging.getLogger("lossguard.agent")

FRAMEWORK_SAVES = ("command", "stop", "signal")
"""Save reasons (the ``save`` and ``stop`` commands, a stop signal) that also ask the framework
for its own checkpoint, the one it resumes from."""


class FrameworkData:
    """The framework's data loader as Guard's checkpoints see it: ``position`` counts the
    batches this timeline has trained on. The loader itself cannot rewind: after a rollback it
    goes on with its next batch, which is past the batches of the abandoned steps."""

    def __init__(self) -> None:
        self.position = 0

    def advance(self, batches: int) -> None:
        """Batches trained on."""
        self.position += batches

    def skip(self, batches: int) -> None:
        """Batches passed over after a rollback (the loader is already past them)."""
        self.position += batches

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        self.position = int(state["position"])


class FrameworkGuard(Guard):
    """A Guard driven by a framework's loop. Its data is ``FrameworkData``; a rollback passes
    over the abandoned steps' batches (the only skip the loader can do), and a save or stop
    also asks the framework for its own checkpoint (``take_framework_save``)."""

    def __init__(self, run_dir: Path, *, framework: str, **kwargs: Any) -> None:
        self.framework = framework
        self.framework_save_due = False
        self.data = FrameworkData()
        super().__init__(run_dir, data=self.data, progress=False, **kwargs)

    def rollback(
        self, target: Target, *, skip_batches: SkipBatches, lr_scale: float
    ) -> dict[str, Any]:
        if skip_batches != ABANDONED:
            raise RestoreError(
                f"skip_batches: {self.framework}'s data loader cannot rewind or skip; a rollback "
                f"always passes over the abandoned steps' batches: pass {ABANDONED!r}",
                bad_request=True,
            )
        return super().rollback(target, skip_batches=skip_batches, lr_scale=lr_scale)

    def save(
        self,
        reason: str = "manual",
        *,
        healthy: bool | None = None,
        wait: bool = False,
        on_done: OnSaved | None = None,
    ) -> None:
        super().save(reason, healthy=healthy, wait=wait, on_done=on_done)
        if reason in FRAMEWORK_SAVES:
            self.framework_save_due = True

    def take_framework_save(self) -> bool:
        """Whether the framework should checkpoint at this boundary (asked once)."""
        due, self.framework_save_due = self.framework_save_due, False
        return due


def batch_inputs(batch: Any) -> torch.Tensor | None:
    """A batch's input tensor: its ``input_ids`` (a mapping), the tensor itself, or the first
    element of a tuple or list; None when none of these is a tensor."""
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids")
    elif isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
        batch = batch[0]
    return batch if isinstance(batch, torch.Tensor) else None


def token_ids(inputs: Any) -> torch.Tensor | None:
    """``inputs`` when it is a tensor of integer ids (what the diagnosis's token statistics
    take), else None."""
    if not isinstance(inputs, torch.Tensor) or inputs.is_floating_point() or inputs.is_complex():
        return None
    return inputs


class FrameworkRun:
    """One ``train``/``fit`` call driven through a ``FrameworkGuard``."""

    def __init__(self, guard: FrameworkGuard, *, tokens_per_step: int | None) -> None:
        self.guard = guard
        self.tokens_per_step = tokens_per_step
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._summed = True
        self._tokens = 0
        self._inputs: list[torch.Tensor] = []  # the step's input ids, if the framework shows them
        self.stepped = False
        """An optimizer step was taken since the last ``step_end``."""
        self._idle = contextlib.ExitStack()
        self._warned_no_tokens = False

    @classmethod
    def start(
        cls,
        run_dir: str | Path,
        *,
        framework: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Stateful | None,
        config: GuardConfig | None,
        max_steps: int | None,
        global_step: int,
        grad_clip: float | None = None,
        overwrite: bool = False,
        tokens_per_step: int | None = None,
    ) -> FrameworkRun:
        """Open the run directory, exporter and control socket. A framework that resumed from
        its own checkpoint (``global_step`` > 0) continues at that step; the run directory's
        earlier lossguard checkpoints, metrics and events are moved aside (Guard's
        ``overwrite``), since the framework's checkpoint is what the run goes on from."""
        if os.environ.get(RESUME_ENV):
            raise ValueError(
                f"${RESUME_ENV} is set: under {framework}, resume with the framework's own "
                "checkpoint, not a lossguard one (unset it)"
            )
        if tokens_per_step is not None and tokens_per_step < 1:
            raise ValueError(f"tokens_per_step: must be >= 1 or None, not {tokens_per_step}")
        guard = FrameworkGuard(
            Path(run_dir),
            framework=framework,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            config=config,
            max_steps=max_steps,
            grad_clip=grad_clip,
            overwrite=overwrite or global_step > 0,
        )
        if global_step:
            guard.progress.step = global_step
            guard.event(CONTINUED, framework=framework)  # at the framework's step
        return cls(guard, tokens_per_step=tokens_per_step)

    def micro_batch(
        self,
        loss: torch.Tensor | None,
        tokens: int,
        *,
        summed: bool,
        inputs: torch.Tensor | None = None,
    ) -> None:
        """A micro-batch's forward and backward: its loss (None: the framework gave none) and
        tokens. ``summed``: the step's loss is the sum of its micro-batches' losses (each
        normalised over the whole step); else their mean. ``inputs``: its input ids, if the
        framework showed them (for the diagnosis's token statistics)."""
        ids = token_ids(inputs)
        if ids is not None:
            self._inputs.append(ids)
        if loss is not None:
            loss = loss.detach().float()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._losses += 1
        self._summed = summed
        self._tokens += tokens
        self.guard.data.advance(1)

    def optimizer_step(self) -> torch.Tensor:
        """Gradients are complete: Guard takes the step's loss and tokens, the gradient norm
        (clipping to ``grad_clip`` if given) and its non-finite and spike checks."""
        self._idle.close()  # an evaluation whose end the framework did not report
        if self._loss_sum is None:
            raise RuntimeError(
                f"lossguard: no training loss seen in this {self.guard.framework} step; the "
                "callback reads the loss the model returns (pass labels) and the framework hands "
                "to backward"
            )
        loss = self._loss_sum if self._summed else self._loss_sum / self._losses
        tokens = self.tokens_per_step if self.tokens_per_step is not None else self._tokens
        if not tokens and not self._warned_no_tokens:
            self._warned_no_tokens = True
            log.warning(
                "lossguard: no input_ids tensor in the batches: tokens/s and MFU read 0; "
                "pass tokens_per_step to the callback"
            )
        norm = self.guard.after_backward(loss, tokens=tokens, inputs=self._inputs or None)
        self._loss_sum, self._losses, self._tokens, self._inputs = None, 0, 0, []
        self.stepped = True
        return norm

    def step_end(self) -> None:
        """The optimizer step is done: Guard's counters, its log interval, periodic checkpoints
        and control commands (a pause blocks here, serving commands, until resumed)."""
        self.stepped = False
        self.guard.end_step()
        self.guard.poll()

    def eval_begins(self) -> None:
        """Evaluation time stays out of step times, tokens/s and MFU."""
        self._idle.close()
        self._idle.enter_context(self.guard.idle())

    def eval_ends(self, val_loss: float | None) -> None:
        self._idle.close()
        if val_loss is not None:
            self.guard.record_eval(val_loss)

    def close(self, *, failed: bool = False) -> None:
        """Export the last partial interval and release the run directory: ``agent.json``
        says completed, stopped or failed."""
        self._idle.close()
        self.guard.close(failed=failed)


class GuardedCallback:
    """What both callbacks keep: the options of their runs, and the run now training (None
    outside ``train``/``fit``)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        config: GuardConfig | None = None,
        tokens_per_step: int | None = None,
        overwrite: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.tokens_per_step = tokens_per_step
        self.overwrite = overwrite
        self.run: FrameworkRun | None = None

    @property
    def guard(self) -> Guard | None:
        """This run's Guard (None outside ``train``/``fit``)."""
        return self.run.guard if self.run is not None else None

    def start_run(self, **framework: Any) -> FrameworkRun:
        """``FrameworkRun.start`` with this callback's options and what the framework says."""
        self.run = FrameworkRun.start(
            self.run_dir,
            config=self.config,
            overwrite=self.overwrite,
            tokens_per_step=self.tokens_per_step,
            **framework,
        )
        return self.run

    def end_run(self, *, failed: bool = False) -> None:
        if self.run is not None:
            self.run.close(failed=failed)
            self.run = None


def framework_wandb_conflict(framework: str, config: GuardConfig | None) -> None:
    """Refuse lossguard's own W&B logging beside the framework's (two W&B runs in one
    process); the framework's logger already has the run."""
    if config is not None and config.wandb.enabled:
        raise ValueError(
            f"wandb.enabled: {framework} already logs to W&B in this run; turn lossguard's "
            "W&B logging off (the callback's metrics go to Prometheus and metrics.jsonl)"
        )
