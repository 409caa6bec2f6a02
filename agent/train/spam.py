"""SPAM, Spike-Aware Adam with Momentum Reset (Huang et al., ICLR 2025, Algorithm 1), dense and
without a host sync: foreach kernels, every step-dependent quantity computed on the device.

The update follows the authors' code (TianjinYellow/SPAM-Optimizer, ``galore_torch/SPAM.py``,
at density 1):

- step ``s`` counts the optimizer's updates, from 1; Adam's bias corrections use it, and it is
  never reset (the global step);
- a momentum reset at every step with ``s % reset_every == 0``: both moments are zeroed before
  the update;
- spike-aware clipping: an entry whose squared gradient exceeds ``threshold`` times its second
  moment (as it stood before this step) is set to ``sign(g) * sqrt(threshold * v)``. Clipping
  runs from step ``clip_after`` on and, within each reset interval, from ``clip_after`` steps
  after the reset (``s % reset_every >= clip_after``): right after a reset the second moment is
  zero and would clip everything;
- the step size ``lr * sqrt(1 - beta2^s) / (1 - beta1^s)`` is scaled by a cosine warm-up after
  each reset: at the ``c``-th step after it (``c = s % reset_every``, 0 at the reset), by
  ``1 - 0.99 * (1 + cos(pi * c / (warmup + 1))) / 2`` while ``c < warmup``, else by 1 (the
  authors' ``CosineDecay(0.99, warmup)``: ``CosineAnnealingLR.step(c)``, closed form;
  pytorch-optimizer 4.1.0's port takes the value at ``c + 1``). No warm-up before the first
  reset;
- decoupled weight decay after the update: ``p -= lr * weight_decay * p``.

Skipped steps (``found_inf``, a 0/1 float device tensor, as the fused AdamW reads it: a
non-finite gradient, or a spike under ``mitigation.skip_spikes``): nothing changes, neither the
parameters nor the moments nor the step count, and no clipped entry is counted.

State: per parameter ``exp_avg``, ``exp_avg_sq`` (like the parameter, DTensors under FSDP2) and
``step`` (a float32 scalar on the parameter's device), so ``state_dict`` and DCP carry it
whole. ``metric_totals``: this process's momentum resets and clipped entries (of this rank's
parameters, its shards under FSDP2/HSDP), running totals on the device, read at log intervals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from lossguard.common.catalogue import OPTIMIZER_COUNTERS

WARMUP_DEPTH = 0.99
"""How far the step size drops at a reset: to 1 - 0.99 of its value (the authors' CosineDecay)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the update is elementwise); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class SPAM(torch.optim.Optimizer):
    """Adam with momentum resets, a warm-up after each and spike-aware clipping (module doc).

    ``honours_found_inf``: it skips a step on the device flag ``found_inf`` as the fused AdamW
    does (``telemetry.hub.skips_on_device``)."""

    honours_found_inf: ClassVar[bool] = True

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        reset_every: int = 500,
        warmup: int = 150,
        threshold: float = 5000.0,
        clip_after: int = 20,
    ) -> None:
        if reset_every < 1 or warmup < 0 or threshold <= 0 or clip_after < 1:
            raise ValueError(
                "SPAM needs reset_every >= 1, warmup >= 0, threshold > 0 and clip_after >= 1"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.reset_every = reset_every
        self.warmup = warmup
        self.threshold = threshold
        self.clip_after = clip_after
        device = self._first_param().device
        self.metric_totals = torch.zeros(len(OPTIMIZER_COUNTERS), dtype=torch.int64, device=device)
        self.found_inf: torch.Tensor | None = None
        self.register_load_state_dict_post_hook(_steps_on_param_devices)

    def _first_param(self) -> torch.Tensor:
        return next(p for group in self.param_groups for p in group["params"])

    def _init_state(self) -> None:
        """Every parameter's state at the first step (one step count for all)."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p)

    def _schedule(self, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """At step ``step`` (float64): (reset now, warm-up factor, clipping on), on the device."""
        position = torch.remainder(step, self.reset_every)
        reset = (position == 0) & (step >= self.reset_every)
        after = torch.where(step >= self.reset_every, position, float(self.warmup))
        cosine = (1 + torch.cos(after * (math.pi / (self.warmup + 1)))) / 2
        factor = torch.where(after < self.warmup, 1 - WARMUP_DEPTH * cosine, 1.0)
        clip = (step >= self.clip_after) & (position >= self.clip_after)
        return reset, factor, clip

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._init_state()
        step = (
            self.state[self._first_param()]["step"].double() + 1
        )  # this update's step, if it is applied
        skip = self.found_inf > 0 if self.found_inf is not None else torch.zeros_like(step) > 0
        reset, factor, clip = self._schedule(step)
        reset = reset & ~skip
        keep = (~skip).to(torch.float32)
        bound_offset = torch.where(clip, 0.0, math.inf).float()  # no clipping: no bound
        counts = []
        for group in self.param_groups:
            counts.extend(self._update_group(group, step, skip, reset, factor, bound_offset))
        steps = [self.state[p]["step"] for g in self.param_groups for p in g["params"]]
        torch._foreach_add_(steps, keep)
        clipped = torch.stack(counts).double().sum() if counts else torch.zeros_like(step)
        self.metric_totals += torch.stack([reset.double(), clipped]).long()
        return loss

    def _update_group(
        self,
        group: dict[str, Any],
        step: torch.Tensor,
        skip: torch.Tensor,
        reset: torch.Tensor,
        factor: torch.Tensor,
        bound_offset: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Clip, update the moments and the parameters of one group; returns the number of
        clipped entries of each parameter (device scalars)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return []
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        exp_avgs = [_local(s["exp_avg"]) for s in states]
        exp_avg_sqs = [_local(s["exp_avg_sq"]) for s in states]
        # a skipped step's gradient may be non-finite: zero it, so that it can change nothing
        raw = [torch.where(skip, 0.0, _local(p.grad)) for p in params]
        grads, counts = self._clip(raw, exp_avg_sqs, bound_offset)
        del raw

        # moments: zeroed at a reset, left alone on a skipped step
        decay1 = torch.where(skip, 1.0, torch.where(reset, 0.0, beta1)).float()
        decay2 = torch.where(skip, 1.0, torch.where(reset, 0.0, beta2)).float()
        torch._foreach_mul_(exp_avgs, decay1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, decay2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

        lr = group["lr"]
        step_size = lr * factor * torch.sqrt(1 - beta2**step) / (1 - beta1**step)
        scale = (-step_size * ~skip).float()
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denominators, group["eps"])
        updates = torch._foreach_div(exp_avgs, denominators)
        del denominators
        torch._foreach_mul_(updates, scale)
        local_params = [_local(p) for p in params]
        torch._foreach_add_(local_params, updates)
        if group["weight_decay"] > 0:
            shrink = 1 - lr * group["weight_decay"] * (~skip).double()
            torch._foreach_mul_(local_params, shrink.float())
        return counts

    def _clip(
        self, grads: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], offset: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Spike-aware clipping: each entry to within +-sqrt(threshold * v) (``offset``: 0,
        or inf when clipping is off), and the number of entries clipped in each tensor. The
        same as the authors' ``sign(g) * sqrt(threshold * v)`` where ``g^2 > threshold * v``."""
        bounds = torch._foreach_mul(exp_avg_sqs, self.threshold)
        torch._foreach_sqrt_(bounds)
        torch._foreach_add_(bounds, offset)
        clipped = list(torch._foreach_minimum(grads, bounds))
        torch._foreach_neg_(bounds)
        torch._foreach_maximum_(clipped, bounds)
        changed = torch._foreach_sub(grads, clipped)  # nonzero where an entry was clipped
        return clipped, list(torch._foreach_norm(changed, 0))


def _steps_on_param_devices(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: each step count back on its parameter's device (torch leaves
    a ``step`` where the loaded state had it unless the optimizer is fused or capturable)."""
    for param, state in optimizer.state.items():
        if "step" in state:
            state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
