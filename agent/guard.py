"""Guard: the one instrumentation API, used alike by the built-in trainer and by user loops.

    guard = Guard(run_dir, model=model, optimizer=opt, scheduler=sched, data=sampler, config=cfg)
    for batch in ...:
        loss = ...; loss.backward()
        guard.after_backward(loss, tokens=n)   # grad norm (and clipping), on device
        opt.step(); sched.step()
        guard.end_step()                       # counters; every log interval: one host sync

Per-step values stay on the device; they are read once per log interval.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import torch
from torch import nn

from .config import Config
from .distributed import all_reduce_sum, rank_and_world
from .progress import ProgressDisplay, make_progress
from .rundir import RunDirectory

log = logging.getLogger("lossguard.agent")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


def device_description(device: torch.device) -> dict[str, Any]:
    """What env.json records about the training device."""
    info: dict[str, Any] = {"type": device.type, "name": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
        )
    else:
        info["threads"] = torch.get_num_threads()
    return info


class Guard:
    """Step and token accounting, gradient norm, metrics log and progress for a training loop."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        data: Stateful | None = None,
        scaler: torch.amp.GradScaler | None = None,
        ema: nn.Module | None = None,
        config: Config | None = None,
        progress: bool = True,
    ) -> None:
        self.config = config if config is not None else Config()
        train = self.config.train
        self.max_steps = train.max_steps
        self.log_every = train.log_every
        self.grad_clip = train.grad_clip
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.state: dict[str, Stateful] = {"model": model}
        extra = {"optimizer": optimizer, "scheduler": scheduler, "data": data}
        extra.update(scaler=scaler, ema=ema)
        self.state.update({k: v for k, v in extra.items() if v is not None})
        self.rank, self.world_size = rank_and_world()
        self.device = next(model.parameters()).device
        self._params = [p for p in model.parameters() if p.requires_grad]

        self.step = 0
        self.tokens_total = 0
        self.last_record: dict[str, Any] | None = None
        self._reset_interval()

        self.run_dir: RunDirectory | None = None
        self._display: ProgressDisplay | None = None
        if self.rank == 0:
            self.run_dir = RunDirectory(Path(run_dir))
            self.run_dir.write_config(self.config.resolved())
            self.run_dir.write_env(device_description(self.device), self.world_size)
            if progress:
                self._display = make_progress(self.max_steps, self.step)

    def _reset_interval(self) -> None:
        zero = torch.zeros((), device=self.device)
        self._loss_sum = zero.clone()
        self._grad_norm_last = zero.clone()
        self._grad_norm_max = zero.clone()
        self._interval_steps = 0
        self._interval_tokens = 0
        self._interval_start = time.perf_counter()
        self._pending_tokens = 0

    def after_backward(self, loss: torch.Tensor, *, tokens: int) -> torch.Tensor:
        """Record the step's loss and tokens; compute (and clip to ``train.grad_clip``) the
        gradient norm. Returns the pre-clip norm as a device tensor; nothing is synced."""
        if self.scaler is not None and self.optimizer is not None:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip is not None:
            norm = nn.utils.clip_grad_norm_(self._params, self.grad_clip, foreach=True)
        else:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = nn.utils.get_total_norm(grads, foreach=True)
        norm = norm.detach().float()
        self._loss_sum += loss.detach().float()
        self._grad_norm_last = norm
        self._grad_norm_max = torch.maximum(self._grad_norm_max, norm)
        self._pending_tokens = int(tokens)
        return norm

    def end_step(self) -> None:
        """Close the optimizer step; at each log interval, sync once and write the metrics."""
        self.step += 1
        self._interval_steps += 1
        self._interval_tokens += self._pending_tokens
        self._pending_tokens = 0
        if self.step % self.log_every == 0 or self.step == self.max_steps:
            self._log_interval()

    def _log_interval(self) -> None:
        if self._interval_steps == 0:
            return
        stats = torch.stack(
            [
                self._loss_sum,
                self._grad_norm_last,
                self._grad_norm_max,
                torch.tensor(float(self._interval_tokens), device=self.device),
            ]
        ).double()
        loss_sum, norm_last, norm_max, tokens = all_reduce_sum(stats).tolist()  # the one sync
        elapsed = time.perf_counter() - self._interval_start
        steps = self._interval_steps
        self.tokens_total += int(tokens)
        record: dict[str, Any] = {
            "kind": "train",
            "step": self.step,
            "time": time.time(),
            "train_loss": loss_sum / (steps * self.world_size),
            "grad_norm": norm_last / self.world_size,
            "grad_norm_max": norm_max / self.world_size,
            "lr": self._learning_rate(),
            "tokens": self.tokens_total,
            "tokens_per_second": tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_seconds": elapsed / steps,
        }
        data = self.state.get("data")
        if data is not None and hasattr(data, "position"):
            record["data_position"] = int(data.position)
        self._emit(record)
        self._reset_interval()

    def record_eval(self, val_loss: float, **extra: float) -> None:
        """Log a validation result (already reduced over ranks) at the current step."""
        record: dict[str, Any] = {
            "kind": "eval",
            "step": self.step,
            "time": time.time(),
            "val_loss": val_loss,
            "val_perplexity": math.exp(min(val_loss, 700.0)),
        }
        record.update(extra)
        self._emit(record)

    def _learning_rate(self) -> float | None:
        if self.optimizer is None:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def _emit(self, record: dict[str, Any]) -> None:
        self.last_record = record
        if self.run_dir is not None:
            self.run_dir.append_metrics(record)
        if self._display is not None:
            self._display.update(record)

    def close(self) -> None:
        """Log the last partial interval and release the run directory and display."""
        self._log_interval()
        if self._display is not None:
            self._display.close()
            self._display = None
        if self.run_dir is not None:
            self.run_dir.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
