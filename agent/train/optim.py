"""Optimisation: AdamW or SPAM over parameter groups, warmup + decay LR schedules, weight EMA."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lossguard.agent.config import OptimConfig, TrainConfig
from lossguard.agent.train.spam import SPAM

NO_DECAY_MODULES = (nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on linear weights only; none on norms, biases and embeddings."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            is_linear_weight = name == "weight" and not isinstance(module, NO_DECAY_MODULES)
            (decay if is_linear_weight and param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, optim: OptimConfig
) -> torch.optim.Optimizer:
    """``optim.name``: fused AdamW (CUDA and CPU, one kernel per step) or SPAM (foreach
    kernels). Either skips a step on a device flag (``found_inf``) without a host sync."""
    groups = parameter_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if optim.name == "spam":
        return SPAM(
            groups,
            lr=cfg.lr,
            betas=betas,
            eps=optim.eps,
            reset_every=optim.reset_every,
            warmup=optim.reset_warmup,
            threshold=optim.threshold,
            clip_after=optim.clip_after,
        )
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=True)


class WarmupSchedule:
    """LR multiplier at optimizer step s: linear warmup, then cosine, linear or constant."""

    def __init__(self, kind: str, warmup_steps: int, max_steps: int, min_ratio: float) -> None:
        self.kind = kind
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        decay_steps = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    schedule = WarmupSchedule(cfg.schedule, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    return LambdaLR(optimizer, schedule)


class WeightEma:
    """Exponential moving average of a model's weights, ``ema = decay*ema + (1-decay)*w``,
    updated with one foreach kernel and no host sync (torch's AveragedModel copies a host
    counter to the device every step). Buffers are copied. ``module`` is the averaged model."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        averaged: list[torch.Tensor] = list(self.module.parameters())
        current = [p.detach() for p in model.parameters()]
        if self.updates == 0:
            torch._foreach_copy_(averaged, current)
        else:
            torch._foreach_lerp_(averaged, current, 1.0 - self.decay)
        for mine, theirs in zip(self.module.buffers(), model.buffers(), strict=True):
            mine.copy_(theirs)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
