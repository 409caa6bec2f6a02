"""``LossguardCallback`` for ``transformers.Trainer`` (the ``huggingface`` extra).

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[LossguardCallback("runs/my-run")])

The Trainer keeps a step's loss inside ``training_step``: the callback reads it from the model's
output (a forward hook on the model, training forwards only), with the tokens of ``input_ids``.
The Trainer clips gradients before any callback sees them, so the callback does its clipping
instead: for the run it takes ``max_grad_norm`` (the Trainer then measures without clipping)
and clips to it right after measuring, so ``lossguard_grad_norm`` is the norm before clipping.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from lossguard.agent.integrations.adapter import GuardedCallback, framework_wandb_conflict
from lossguard.agent.integrations.sharding import refuse_unguardable
from lossguard.common.rundir.events import FRAMEWORK_CHECKPOINT

FRAMEWORK = "transformers.Trainer"


class LossguardCallback(GuardedCallback, TrainerCallback):
    """Guard for a ``transformers.Trainer`` run: ``run_dir`` (agent.json, metrics, events,
    lossguard checkpoints, the control socket), ``config`` (its ``checkpoint``, ``control``,
    ``telemetry``, ``wandb`` sections and ``train.log_every``), ``tokens_per_step`` (default:
    the ``input_ids`` of each step's batches), ``overwrite`` (start over in a run directory
    that has lossguard checkpoints)."""

    _hook: torch.utils.hooks.RemovableHandle | None = None
    _max_grad_norm = 0.0  # the Trainer's, handed back when training ends

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        model: nn.Module = kwargs["model"]
        optimizer = kwargs["optimizer"]
        if args.deepspeed:
            raise ValueError(
                "LossguardCallback: DeepSpeed keeps the gradients and optimizer state in its own "
                "engine, out of the callback's reach; use accelerate's FSDP2 "
                "(fsdp_config={'version': 2}), DDP or one process"
            )
        refuse_unguardable(FRAMEWORK, model, "fsdp_config={'version': 2}")
        if "wandb" in (args.report_to or []):
            framework_wandb_conflict(FRAMEWORK, self.config)
        self._max_grad_norm = args.max_grad_norm
        self.start_run(
            framework=FRAMEWORK,
            model=model,
            optimizer=getattr(optimizer, "optimizer", optimizer),  # inside accelerate's wrapper
            scheduler=kwargs.get("lr_scheduler"),
            max_steps=state.max_steps if state.max_steps > 0 else None,
            global_step=state.global_step,
            grad_clip=args.max_grad_norm if args.max_grad_norm > 0 else None,
        )
        args.max_grad_norm = 0.0  # the callback clips, after measuring
        self._hook = model.register_forward_hook(self._forward_done, with_kwargs=True)

    def _forward_done(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        """A training forward: its loss (on the device) and tokens."""
        if self.run is None or not (module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, Mapping) else None
        ids = kwargs.get(getattr(module, "main_input_name", "input_ids"))
        tokens = ids.numel() if isinstance(ids, torch.Tensor) else 0
        # with num_items_in_batch the model normalises each micro-batch over the whole step
        self.run.micro_batch(loss, tokens, summed="num_items_in_batch" in kwargs, inputs=ids)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.run is not None:
            self.run.optimizer_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        run = self.run
        if run is None:
            return
        run.step_end()
        if run.guard.take_framework_save():
            control.should_save = True  # the Trainer saves right after this callback
        if run.guard.stop_requested:
            control.should_training_stop = True
        if control.should_evaluate:
            run.eval_begins()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.run is not None and control.should_evaluate:
            self.run.eval_begins()

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.run is not None:
            self.run.eval_ends((metrics or {}).get("eval_loss"))

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.run is not None:
            path = Path(args.output_dir or ".") / f"checkpoint-{state.global_step}"
            self.run.guard.event(FRAMEWORK_CHECKPOINT, path=str(path))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        args.max_grad_norm = self._max_grad_norm
        self.end_run()
