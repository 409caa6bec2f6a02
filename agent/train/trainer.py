"""The built-in trainer: a GPT from a Config, trained through the public Guard API."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lossguard.agent.config import Config
from lossguard.agent.distributed import (
    all_reduce_sum,
    barrier,
    broadcast_from_main,
    setup_distributed,
    teardown_distributed,
)
from lossguard.agent.guard import Guard
from lossguard.agent.precision import (
    autocast,
    convert_to_fp8,
    fp8_all_gather,
    make_grad_scaler,
    precompute_fp8_scales,
)
from lossguard.agent.resume_plan import check_start, command_plan, run_path
from lossguard.agent.train.corpus import Batch, BatchSampler, cache_dir, load_data
from lossguard.agent.train.faults import FaultInjector, check_fault_ranks
from lossguard.agent.train.flops import flops_per_token
from lossguard.agent.train.model import GPT
from lossguard.agent.train.optim import WeightEma, build_optimizer, build_scheduler
from lossguard.agent.train.sharding import device_mesh, gradient_sync, shard_gpt
from lossguard.common.control.protocol import Target

log = logging.getLogger("lossguard.agent")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + os.urandom(2).hex()


class EarlyStopping:
    """Stops when validation loss has not improved for ``patience`` evaluations after warmup."""

    def __init__(self, patience: int, min_delta: float, warmup_steps: int) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.warmup_steps = warmup_steps
        self.best = math.inf
        self.bad_evals = 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.bad_evals = int(state["bad_evals"])

    def should_stop(self, step: int, val_loss: float) -> bool:
        if val_loss < self.best - self.min_delta:
            self.best = val_loss
            self.bad_evals = 0
            return False
        if step <= self.warmup_steps:
            return False
        self.bad_evals += 1
        return self.bad_evals >= self.patience


@dataclass(frozen=True)
class FitResult:
    steps: int
    stop_reason: str
    run_dir: Path
    best_val_loss: float | None


class Trainer:
    """Builds data, model, precision and optimiser from a Config and trains with Guard."""

    def __init__(
        self,
        cfg: Config,
        *,
        progress: bool = True,
        resume: Target | None = None,
        skip_batches: int = 0,
        overwrite: bool = False,
    ) -> None:
        """``resume``, ``skip_batches`` and ``overwrite`` are Guard's (``$LOSSGUARD_RESUME``
        wins); a run directory with checkpoints needs one of them (``CheckpointsExist``)."""
        start = command_plan(resume, skip_batches, overwrite)
        check_start(run_path(cfg), start, afresh=False)  # rank 0's Guard checks a start afresh
        check_fault_ranks(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.dist = setup_distributed(
            cfg.run.device,
            timeout_s=cfg.distributed.timeout.seconds,
            always=cfg.distributed.sharded,
        )
        self.device = self.dist.device
        cfg = cfg.model_copy(deep=True)
        cfg.run.id = broadcast_from_main(
            cfg.run.id or new_run_id(), "broadcast_object_list: run id"
        )
        self.cfg = cfg
        self.run_path = cfg.run.dir / str(cfg.run.id)
        seed_everything(cfg.run.seed)

        cache = cache_dir(cfg.data, cfg.run.dir)
        if self.dist.is_main:  # rank 0 tokenises and caches; the others then read the cache
            self.data = load_data(cfg.data, cache, cfg.model.vocab_size)
        barrier("barrier: data cache ready")
        if not self.dist.is_main:
            self.data = load_data(cfg.data, cache, cfg.model.vocab_size)
        self.sampler = BatchSampler(
            self.data,
            block_size=cfg.model.block_size,
            batch_size=cfg.train.batch_size,
            grad_accum=cfg.train.grad_accum,
            seed=cfg.run.seed,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )

        self.raw_model = GPT(cfg.model, self.data.vocab_size)
        self.n_params = self.raw_model.num_params()
        sharded = cfg.distributed.sharded
        self.fp8_layers = 0
        self.fp8_all_gather = fp8_all_gather(cfg.precision, self.device, sharded)
        if cfg.precision.dtype == "fp8":
            self.fp8_layers = convert_to_fp8(
                self.raw_model, cfg.precision, self.device, all_gather=self.fp8_all_gather
            )
        self.raw_model.to(self.device)
        if sharded:
            mesh = device_mesh(cfg.distributed, self.dist.world_size, self.device)
            shard_gpt(
                self.raw_model,
                cfg.distributed,
                cfg.precision.dtype,
                mesh,
                compile_backend=cfg.model.compile_backend if cfg.model.compile else None,
            )
        torch.manual_seed(cfg.run.seed + self.dist.rank)  # dropout differs across ranks
        self.ema = WeightEma(self.raw_model, cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.optimizer = build_optimizer(self.raw_model, cfg.train, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.scaler = make_grad_scaler(cfg.precision.dtype, self.device)
        model: nn.Module = self.raw_model
        if cfg.model.compile and not sharded:  # sharded: per block, above
            model = torch.compile(model, backend=cfg.model.compile_backend)  # type: ignore[assignment]
        if self.dist.enabled and not sharded:
            ids = [self.dist.local_rank] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
        self.model = model
        self.early_stopping = (
            EarlyStopping(
                cfg.train.early_stopping.patience,
                cfg.train.early_stopping.min_delta,
                cfg.train.warmup_steps,
            )
            if cfg.train.early_stopping
            else None
        )
        try:
            self.guard = Guard(
                self.run_path,
                model=self.raw_model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                data=self.sampler,
                scaler=self.scaler,
                ema=self.ema,
                config=cfg,
                max_steps=cfg.train.max_steps,
                grad_clip=cfg.train.grad_clip,
                resume=resume,
                skip_batches=skip_batches,
                overwrite=overwrite,
                progress=progress,
                flops_per_token=flops_per_token(
                    self.n_params,
                    cfg.model.n_layer,
                    cfg.model.n_head,
                    cfg.model.n_embd // cfg.model.n_head,
                    cfg.model.block_size,
                ),
            )
        except BaseException:
            teardown_distributed(together=False)
            raise
        self.faults = FaultInjector(
            cfg.faults,
            seed=cfg.run.seed,
            vocab_size=self.data.vocab_size,
            model=self.raw_model,
            optimizer=self.optimizer,
            event=self.guard.event,
            rank=self.dist.rank,
            grad_accum=cfg.train.grad_accum,
        )
        if self.early_stopping is not None:  # after a resume: loaded from the checkpoint
            self.guard.register("early_stopping", self.early_stopping)
        if self.dist.is_main:
            log.info(
                "run %s: %s; model %.2fM params (%d fp8 layers); %s on %s x%d (%s); %d tokens/step",
                cfg.run.id,
                self.data.description,
                self.n_params / 1e6,
                self.fp8_layers,
                cfg.precision.dtype,
                self.device,
                self.dist.world_size,
                cfg.distributed.strategy,
                self.sampler.tokens_per_step * self.dist.world_size,
            )

    def _to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (torch.from_numpy(a) for a in batch)
        if self.device.type == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
            y = y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def _micro_step_context(
        self, model: nn.Module, micro: int
    ) -> contextlib.AbstractContextManager[None]:
        """Skip DDP's gradient all-reduce (FSDP2's reduce-scatter) on all but the last
        micro-batch."""
        last = micro == self.cfg.train.grad_accum - 1
        gradient_sync(model, last)
        if isinstance(model, DistributedDataParallel) and not last:
            return model.no_sync()
        return contextlib.nullcontext()

    def train_step(self) -> None:
        """One optimizer step over ``grad_accum`` micro-batches, through the fault hooks."""
        self.faults.before_step(self.guard.step + 1)
        if self.guard.checkpoints is not None:
            self.guard.checkpoints.write_delay_s = self.faults.save_delay()
        batches = self.faults.batches(self.sampler.next_step())
        inputs: list[torch.Tensor] = []
        step_loss = self._forward_backward(batches, self.model, inputs=inputs)
        self.guard.after_backward(
            step_loss,
            tokens=self.sampler.tokens_per_step,
            replay=lambda shadow: self._forward_backward(batches, shadow, shadow),
            inputs=inputs,
        )
        with self.faults.optimizer_step():
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        if self.fp8_all_gather:
            precompute_fp8_scales(self.raw_model)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.raw_model)
        self.guard.end_step()

    def _forward_backward(
        self,
        batches: list[Batch],
        model: nn.Module,
        unwrapped: nn.Module | None = None,
        inputs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of the step's micro-batches through ``model`` (the trained one,
        or the FP8 fidelity check's shadow, ``unwrapped`` being the module the fault hooks go
        on: by default the trained model); returns the step's loss. ``inputs`` gets each
        micro-batch's input ids, on the device."""
        accum = self.cfg.train.grad_accum
        step_loss = torch.zeros((), device=self.device)
        with self.faults.forward(unwrapped):
            for micro, batch in enumerate(batches):
                x, y = self._to_device(batch)
                if inputs is not None:
                    inputs.append(x)
                with self._micro_step_context(model, micro):
                    with autocast(self.cfg.precision.dtype, self.device):
                        _, loss = model(x, y)
                    loss = self.faults.loss(loss / accum)
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                step_loss += loss.detach()
        return step_loss

    @torch.no_grad()
    def _val_loss(self, model: nn.Module) -> float:
        model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for batch in self.sampler.val_batches(self.cfg.train.eval_batches):
            x, y = self._to_device(batch)
            with autocast(self.cfg.precision.dtype, self.device):
                _, loss = model(x, y)
            total += loss.double()
        model.train()
        count = self.cfg.train.eval_batches * self.dist.world_size
        return float(all_reduce_sum(total, "all_reduce: validation loss").item()) / count

    def evaluate(self) -> dict[str, float]:
        """Validation loss over a fixed set of batches (and of the EMA weights, if kept)."""
        result = {"val_loss": self._val_loss(self.raw_model)}
        if self.ema is not None:
            result["val_loss_ema"] = self._val_loss(self.ema.module)
        return result

    def fit(self) -> FitResult:
        """Train to ``train.max_steps``, until early stopping, or until stopped. Evaluates at
        the start, every ``eval_every`` steps and at the end, before the step boundary's
        ``poll`` (so a checkpoint or snapshot of that step carries its val loss); not again at
        a step restored with its val loss (a rollback goes on training at once)."""
        train = self.cfg.train
        stop_reason = "max_steps"
        best = math.inf
        while True:
            step = self.guard.step
            evaluated = self.guard.last_val is not None and self.guard.last_val[0] == step
            if (step % train.eval_every == 0 or step == train.max_steps) and not evaluated:
                with self.guard.idle():
                    metrics = self.evaluate()
                val_loss = metrics.pop("val_loss")
                best = min(best, val_loss)
                self.guard.record_eval(val_loss, **metrics)
                if self.early_stopping and self.early_stopping.should_stop(step, val_loss):
                    stop_reason = "early_stopping"
                    log.info("early stopping at step %d: best val_loss %.4f", step, best)
                    break
            self.guard.poll()
            if self.guard.stop_requested:
                stop_reason = "stopped"
                break
            if self.guard.step >= train.max_steps:
                break
            if self.guard.step == step:
                self.train_step()
        self.guard.finish()
        return FitResult(self.guard.step, stop_reason, self.run_path, best)

    def close(self, *, failed: bool = False) -> None:
        """Release the run; after a failure, without collectives the other ranks may not join."""
        self.guard.close(failed=failed)
        teardown_distributed(together=not failed)
