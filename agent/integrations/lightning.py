"""``LossguardCallback`` for PyTorch Lightning (the ``lightning`` extra).

    trainer = L.Trainer(max_steps=10_000, callbacks=[LossguardCallback("runs/my-run")])

Lightning hands the callback each micro-batch's loss before backward and calls it again before
the optimizer step, before it clips the gradients: the gradient norm is taken there, so
``lossguard_grad_norm`` is the norm before Lightning's ``gradient_clip_val``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    SingleDeviceXLAStrategy,
    Strategy,
    XLAStrategy,
)

from lossguard.agent.config import GuardConfig
from lossguard.agent.integrations.adapter import (
    GuardedCallback,
    batch_inputs,
    framework_wandb_conflict,
)
from lossguard.agent.integrations.sharding import refuse_unguardable
from lossguard.common.rundir.events import FRAMEWORK_CHECKPOINT

FRAMEWORK = "Lightning"


SUPPORTED = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
XLA = (XLAStrategy, SingleDeviceXLAStrategy)  # subclasses of supported ones, not supported


def strategy_refusal(strategy: Strategy) -> str | None:
    """Why the callback cannot guard a run under ``strategy`` (None: it can)."""
    if isinstance(strategy, FSDPStrategy):
        return (
            "FSDPStrategy wraps the model in FSDP1 (FullyShardedDataParallel), whose flattened "
            "shards the callback can neither measure nor checkpoint; use ModelParallelStrategy "
            "with fully_shard (FSDP2) in configure_model"
        )
    if isinstance(strategy, DeepSpeedStrategy):
        return (
            "DeepSpeedStrategy keeps the gradients and optimizer state in its own engine, out of "
            "the callback's reach; use ModelParallelStrategy with fully_shard (FSDP2) or DDP"
        )
    if isinstance(strategy, XLA) or not isinstance(strategy, SUPPORTED):
        return (
            f"strategy {type(strategy).__name__} is not supported; the callback supports one "
            "device, DDP and ModelParallelStrategy (FSDP2)"
        )
    return None


class LossguardCallback(GuardedCallback, pl.Callback):
    """Guard for a Lightning ``fit``: ``run_dir`` (agent.json, metrics, events, lossguard
    checkpoints, the control socket), ``config`` (its ``checkpoint``, ``control``,
    ``telemetry``, ``wandb`` sections and ``train.log_every``), ``tokens_per_step`` (default:
    counted in each batch: its ``input_ids``, the batch tensor, or a tuple's first element),
    ``overwrite`` (start over in a run directory that has lossguard checkpoints),
    ``val_loss_key`` (the logged metric exported as ``lossguard_val_loss``) and
    ``checkpoint_dir`` (where the ``save`` and ``stop`` commands have Lightning write its own
    checkpoint; default: the ModelCheckpoint's folder, else ``default_root_dir/checkpoints``)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        config: GuardConfig | None = None,
        tokens_per_step: int | None = None,
        overwrite: bool = False,
        val_loss_key: str = "val_loss",
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        super().__init__(
            run_dir, config=config, tokens_per_step=tokens_per_step, overwrite=overwrite
        )
        self.val_loss_key = val_loss_key
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._batch_inputs: torch.Tensor | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refusal = strategy_refusal(trainer.strategy)
        if refusal is not None:
            raise ValueError(f"LossguardCallback: {refusal}")
        refuse_unguardable(FRAMEWORK, pl_module, "fully_shard in configure_model")
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"LossguardCallback: needs exactly one optimizer, not {len(trainer.optimizers)}"
            )
        if any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
            framework_wandb_conflict(FRAMEWORK, self.config)
        schedulers = trainer.lr_scheduler_configs
        total = trainer.estimated_stepping_batches
        self.start_run(
            framework=FRAMEWORK,
            model=pl_module,
            optimizer=trainer.optimizers[0],
            scheduler=schedulers[0].scheduler if schedulers else None,
            max_steps=int(total) if math.isfinite(total) else None,
            global_step=trainer.global_step,
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_inputs = batch_inputs(batch)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self.run is not None:  # Lightning divides the loss by accumulate_grad_batches
            inputs = self._batch_inputs
            tokens = inputs.numel() if inputs is not None else 0
            self.run.micro_batch(loss, tokens, summed=True, inputs=inputs)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.run is not None:
            self.run.optimizer_step()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        run = self.run
        if run is None or not run.stepped:  # a micro-batch of an accumulating step
            return
        run.step_end()
        if run.guard.take_framework_save():
            path = self._checkpoint_dir(trainer) / f"lossguard-step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            run.guard.event(FRAMEWORK_CHECKPOINT, path=str(path))
        if run.guard.stop_requested:
            trainer.should_stop = True

    def _checkpoint_dir(self, trainer: pl.Trainer) -> Path:
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None and not trainer.sanity_checking:
            self.run.eval_begins()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is None or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.val_loss_key)
        self.run.eval_ends(float(value) if value is not None else None)  # once per evaluation

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end_run()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.end_run(failed=True)
