"""Fault injection (config ``faults:``) for tests, demos and drills.

Each fault perturbs the real training from step ``step`` for ``duration`` steps; none writes a
made-up metric value. What the run then reports is what the perturbed training did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from lossguard.agent.config import Config, FaultConfig
from lossguard.agent.train.corpus import Batch
from lossguard.common.config import ConfigError
from lossguard.common.rundir.events import FAULT

log = logging.getLogger("lossguard.agent")

_UNPERTURBED = contextlib.nullcontext()


@dataclass(eq=False)
class FaultInjector:
    """The configured faults, applied at the trainer's hook points. Each step calls, in order:
    ``before_step``, ``batches``, ``forward`` (around forward and backward, with ``loss`` on
    each micro-batch's loss) and ``optimizer_step``. With no fault active a hook only looks
    at an empty dict: nothing syncs with the device."""

    faults: list[FaultConfig]
    seed: int
    vocab_size: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    event: Callable[..., None]
    rank: int = 0
    grad_accum: int = 1  # micro-batches a step (``loss_shift`` adds its share to each)
    step: int = field(default=0, init=False)
    active: dict[str, FaultConfig] = field(default_factory=dict, init=False)
    """The faults of ``step`` on this rank, by kind (of two of a kind, the one configured last).
    A fault's start is audited (rank 0) whichever ranks it hits."""
    passed: int = field(default=0, init=False)
    """The furthest step started: a ``once`` fault perturbs no step at or before it again."""

    def before_step(self, step: int) -> None:
        """Start ``step``: record the faults that begin at it, then crash, hang or stall."""
        if not self.faults:
            return
        self.step = step
        first_pass = step > self.passed
        self.passed = max(self.passed, step)
        now = [
            f
            for f in self.faults
            if f.step <= step < f.step + f.duration and (first_pass or not f.once)
        ]
        for fault in now:
            if fault.step == step:
                self.event(FAULT, **fault.model_dump())
        self.active = {f.kind: f for f in now if f.ranks is None or self.rank in f.ranks}
        if "crash" in self.active:
            crash(step)
        if "hang" in self.active:
            hang()
        if stall := self.active.get("slow_step"):
            time.sleep(stall.seconds)

    def save_delay(self) -> float:
        """Seconds a checkpoint written during this step takes longer (``slow_save``)."""
        stall = self.active.get("slow_save")
        return stall.seconds if stall else 0.0

    def batches(self, batches: list[Batch]) -> list[Batch]:
        """The step's batches; uniform random tokens instead during ``corrupt_batch``."""
        if "corrupt_batch" not in self.active:
            return batches
        rng = np.random.default_rng([self.seed, 7919, self.step])
        corrupted = []
        for x, _ in batches:
            window = rng.integers(0, self.vocab_size, size=(x.shape[0], x.shape[1] + 1))
            corrupted.append((window[:, :-1], window[:, 1:]))
        return corrupted

    def forward(self, model: nn.Module | None = None) -> contextlib.AbstractContextManager[None]:
        """Around the forward and backward passes of ``model`` (default: the trained one; the
        FP8 fidelity check replays a step on its shadow copy): scales activations during
        ``scale_activations``, plants an outlier in them during ``activation_outlier``."""
        edits: list[Callable[[torch.Tensor], torch.Tensor]] = []
        if fault := self.active.get("scale_activations"):
            edits.append(scaled(fault.factor))
        if "activation_outlier" in self.active:
            edits.append(plant_outlier)
        if not edits:
            return _UNPERTURBED
        return edited_activations(self.model if model is None else model, edits)

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's (accumulation-scaled) loss; NaN during ``nonfinite_loss``; during
        ``loss_shift``, its share of ``amount`` added (the step's loss goes up by ``amount``,
        its gradients stay as they were)."""
        if "nonfinite_loss" in self.active:
            return loss * float("nan")
        if shift := self.active.get("loss_shift"):
            return loss + shift.amount / self.grad_accum
        return loss

    def optimizer_step(self) -> contextlib.AbstractContextManager[None]:
        """Around the optimizer step: scales the learning rate during ``lr_scale``."""
        fault = self.active.get("lr_scale")
        return scaled_lr(self.optimizer, fault.factor) if fault else _UNPERTURBED


def check_fault_ranks(cfg: Config, world_size: int) -> None:
    """A fault aimed at a rank this run does not have is a configuration error."""
    for i, fault in enumerate(cfg.faults):
        beyond = [r for r in fault.ranks or [] if r >= world_size]
        if beyond:
            raise ConfigError(
                f"faults[{i}].ranks: rank {beyond[0]} is not in this run of {world_size} ranks"
            )


OUTLIER = 2.0**20
"""``activation_outlier``: the planted value, times the tensor's largest magnitude. FP8 e4m3
spans 448 down to 2^-9 (about 2^17.8); at a tensorwise scale set by this value every other
element of the tensor falls below half the smallest step and becomes 0."""


@contextlib.contextmanager
def edited_activations(
    model: nn.Module, edits: list[Callable[[torch.Tensor], torch.Tensor]]
) -> Iterator[None]:
    """Apply ``edits`` to the output of every LayerNorm feeding an attention or MLP block (the
    inputs of the linear layers, where FP8 casts happen)."""

    def hook(_module: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        for edit in edits:
            out = edit(out)
        return out

    norms = [m for name, m in model.named_modules() if name.endswith(("ln_1", "ln_2"))]
    handles = [norm.register_forward_hook(hook) for norm in norms]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def scaled(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``scale_activations``: every element times ``factor``."""
    return lambda out: out * factor


def plant_outlier(out: torch.Tensor) -> torch.Tensor:
    """``activation_outlier``: the last element (last sequence, token and channel) becomes
    ``OUTLIER`` times the tensor's largest magnitude, on the device (no host read)."""
    planted = out.clone(memory_format=torch.contiguous_format)
    planted.view(-1)[-1] = out.detach().abs().amax() * OUTLIER
    return planted


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Multiply every parameter group's learning rate for one optimizer step."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
    try:
        yield
    finally:
        for group in optimizer.param_groups:
            group["lr"] /= factor


def hang() -> None:
    """Stop making progress, as a deadlocked job would: only SIGKILL ends it."""
    log.error("fault: hanging (injected)")
    threading.Event().wait()


def crash(step: int) -> None:
    """End the process at once, as a hard crash would: no cleanup, no checkpoint."""
    print(f"lossguard-agent: fault: crashing at step {step} (injected)", file=sys.stderr)
    sys.stderr.flush()
    os._exit(70)
