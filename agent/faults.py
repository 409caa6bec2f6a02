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
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from .config import FaultConfig
from .data import Batch

log = logging.getLogger("lossguard.agent")


class FaultSchedule:
    """The configured faults, by the (1-based) step they perturb."""

    def __init__(self, faults: list[FaultConfig], seed: int) -> None:
        self.faults = faults
        self.seed = seed

    def active(self, step: int) -> list[FaultConfig]:
        return [f for f in self.faults if f.step <= step < f.step + f.duration]

    def corrupt(self, batches: list[Batch], step: int, vocab_size: int) -> list[Batch]:
        """Replace the step's batches with uniform random tokens."""
        rng = np.random.default_rng([self.seed, 7919, step])
        corrupted = []
        for x, _ in batches:
            window = rng.integers(0, vocab_size, size=(x.shape[0], x.shape[1] + 1))
            corrupted.append((window[:, :-1], window[:, 1:]))
        return corrupted


@contextlib.contextmanager
def scaled_activations(model: nn.Module, factor: float) -> Iterator[None]:
    """Multiply the output of every LayerNorm feeding an attention or MLP block by ``factor``
    (the inputs of the linear layers, where FP8 casts happen)."""
    norms = [m for name, m in model.named_modules() if name.endswith(("ln_1", "ln_2"))]
    handles = [n.register_forward_hook(lambda _m, _i, out: out * factor) for n in norms]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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


def slow(seconds: float) -> None:
    time.sleep(seconds)
