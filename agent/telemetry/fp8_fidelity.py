"""FP8 fidelity, sampled: the same step through a high-precision shadow of the model.

The shadow is the model with every torchao ``Float8Linear`` swapped back to ``nn.Linear``. Its
parameters are separate autograd leaves over the live parameters' storage, so the shadow always
holds the current weights without a copy, and its gradients go to its own ``.grad``, never to
the live ones. At each check they are re-pointed at the live storage (in case a parameter's
data was replaced) and the buffers are copied over; the shadow has no optimizer.

``arm()`` before a check step's forward takes the RNG states; ``check()`` after its backward
(before clipping and the optimizer step) replays the step on the shadow from those states
(the same dropout masks), in fp32 (autocast off) or under bf16 autocast, then restores the RNG
states the training left, so the run goes on exactly as without the check. It compares per
layer (a module with parameters of its own: weight and bias together) the cosine similarity of
the live and shadow gradients, and the relative error of the loss, with one host read. Under
torchrun the shadow's gradients are averaged over ranks first, as DDP averaged the live ones.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lossguard.agent.distributed import all_reduce_sum, rank_and_world
from lossguard.agent.precision import quiet_cuda_kernel_warnings
from lossguard.agent.rng import capture_rng, restore_rng

Replay = Callable[[nn.Module], torch.Tensor]
"""Runs the step's forward and backward again on the module it is given and returns the loss
as the step's own (over all micro-batches, as passed to ``Guard.after_backward``)."""

SHADOW_AUTOCAST: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
TINY = 1e-300  # guards the divisions; float64 throughout


class Reference(nn.Module):
    """The shadow in the reference precision, whatever autocast the caller has open."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device_type = next(self.model.parameters()).device.type
        if self.dtype is None:
            context = torch.autocast(device_type, enabled=False)
        else:
            context = torch.autocast(device_type, dtype=self.dtype)
        with context:
            return self.model(*args, **kwargs)


def build_shadow(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters share the live storage (new autograd leaves), with
    every Float8Linear swapped back to nn.Linear; hooks are not copied."""
    with quiet_cuda_kernel_warnings(next(model.parameters()).device):
        from torchao.float8.float8_linear import Float8Linear

    memo: dict[int, Any] = {
        id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in model.parameters()
    }
    for module in model.modules():  # hooks on the live model (samplers, loggers) stay there
        for key, value in vars(module).items():
            if "hooks" in key and isinstance(value, dict):
                memo[id(value)] = type(value)()
    shadow = copy.deepcopy(model, memo)
    for name, module in list(shadow.named_modules()):
        if isinstance(module, Float8Linear):
            linear = nn.Linear(
                module.in_features, module.out_features, bias=module.bias is not None, device="meta"
            )
            linear.weight = module.weight
            linear.bias = module.bias
            parent, _, child = name.rpartition(".")
            setattr(shadow.get_submodule(parent), child, linear)
    return shadow


Pairs = list[tuple[nn.Parameter, nn.Parameter]]


def _layers(model: nn.Module, shadow: nn.Module) -> dict[str, Pairs]:
    """Each trained live parameter (tied ones once) with its shadow, grouped by the module
    that holds them."""
    shadow_params = dict(shadow.named_parameters())
    layers: dict[str, Pairs] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            module = name.rpartition(".")[0] or name
            layers.setdefault(module, []).append((param, shadow_params[name]))
    return layers


def _cosine(pairs: Pairs, zero: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the live and shadow gradients of one layer, in float64 on the
    device: 1 where both are zero (or absent), 0 where one is."""
    dot, live_sq, shadow_sq = zero, zero, zero
    for live, shadow in pairs:
        g = live.grad.reshape(-1).double() if live.grad is not None else None
        h = shadow.grad.reshape(-1).double() if shadow.grad is not None else None
        if g is not None:
            live_sq = live_sq + torch.dot(g, g)
        if h is not None:
            shadow_sq = shadow_sq + torch.dot(h, h)
        if g is not None and h is not None:
            dot = dot + torch.dot(g, h)
    both_zero = (live_sq == 0) & (shadow_sq == 0)
    return torch.where(both_zero, 1.0, dot / (live_sq * shadow_sq).sqrt().clamp(min=TINY))


class Fp8Fidelity:
    """Sampled comparison of a model's FP8 gradients with those of a high-precision shadow."""

    def __init__(self, model: nn.Module, dtype: str) -> None:
        self.model = model
        self.dtype = dtype
        self.shadow = build_shadow(model)
        self.reference = Reference(self.shadow, SHADOW_AUTOCAST[dtype])
        self._layers = _layers(model, self.shadow)
        self._pairs = list(zip(model.parameters(), self.shadow.parameters(), strict=True))
        self._buffers = list(zip(model.buffers(), self.shadow.buffers(), strict=True))
        self._rng: dict[str, Any] | None = None

    @property
    def layers(self) -> list[str]:
        """The layers compared: modules with parameters of their own."""
        return list(self._layers)

    @property
    def armed(self) -> bool:
        return self._rng is not None

    def arm(self) -> None:
        """Before the forward of a check step: take the RNG states it starts from (again, if
        armed: a restore in between moved them)."""
        self._rng = capture_rng()

    def disarm(self) -> None:
        """Drop the armed check (the step gave no way to replay it)."""
        self._rng = None

    def check(self, loss: torch.Tensor, replay: Replay) -> dict[str, Any] | None:
        """After the armed step's backward: replay it on the shadow and compare. None if not
        armed. The live gradients, parameters and RNG states are left as they were."""
        if self._rng is None:
            return None
        start, self._rng = self._rng, None
        resume = capture_rng()
        self._refresh()
        try:
            restore_rng(start)
            ref_loss = replay(self.reference).detach()
            self._average_over_ranks()
            values = self._compare(loss.detach(), ref_loss).tolist()  # the one host read
        finally:
            restore_rng(resume)
            self.shadow.zero_grad(set_to_none=True)
        *cosines, live_loss, reference_loss = values
        layers = dict(zip(self._layers, cosines, strict=True))
        worst = min(layers, key=lambda k: -math.inf if math.isnan(layers[k]) else layers[k])
        return {
            "dtype": self.dtype,
            "min_grad_cosine": layers[worst],
            "layer": worst,
            "loss": live_loss,
            "reference_loss": reference_loss,
            "loss_rel_error": abs(live_loss - reference_loss) / max(abs(reference_loss), TINY),
            "layers": layers,
        }

    @torch.no_grad()
    def _refresh(self) -> None:
        """The shadow sees the live weights (re-pointed, no copy), buffers and mode."""
        for live, shadow in self._pairs:
            shadow.data = live.data
        for live_buffer, shadow_buffer in self._buffers:
            shadow_buffer.copy_(live_buffer)
        self.shadow.train(self.model.training)

    @torch.no_grad()
    def _average_over_ranks(self) -> None:
        world = rank_and_world()[1]
        if world == 1:
            return
        for _, shadow in self._pairs:
            if shadow.grad is None:  # every rank reduces every parameter: the same collectives
                shadow.grad = torch.zeros_like(shadow)
            all_reduce_sum(shadow.grad, "all_reduce: FP8 fidelity shadow gradients").div_(world)

    @torch.no_grad()
    def _compare(self, loss: torch.Tensor, ref_loss: torch.Tensor) -> torch.Tensor:
        """Every layer's cosine, then the two losses, as one float64 tensor on the device."""
        zero = torch.zeros((), device=loss.device, dtype=torch.float64)
        cosines = [_cosine(pairs, zero) for pairs in self._layers.values()]
        return torch.stack([*cosines, loss.double(), ref_loss.double()])
