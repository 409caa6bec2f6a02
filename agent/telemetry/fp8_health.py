"""FP8 health of torchao Float8Linear layers, sampled: amax, overflow and underflow per tensor.

``arm()`` before the forward of a sampled step hooks every Float8Linear; ``collect()`` after that
step's backward removes the hooks and returns the numbers. Unarmed steps carry no hooks and cost
nothing. Statistics are computed on device inside the hooks (no activation is kept) and read to
the host once, in ``collect()``; micro-batches of an armed step accumulate.

Per layer and tensor (``input``, ``weight``, ``grad_output``), in the FP8 format that the layer's
torchao config casts it to (tensorwise recipe: input and weight e4m3, grad_output e5m2; rowwise:
all e4m3, with power-of-2 scales):

- ``amax``: max |x| of the high-precision tensor.
- ``underflow``: of the nonzero finite values, the fraction that become 0 when really cast to FP8
  at torchao's dynamic scale ``fp8_max / amax``. Tensorwise: one amax per tensor, exactly as
  torchao scales it. Rowwise: one amax per row over the last dim, which is how torchao scales the
  forward and grad_input casts; the casts for grad_weight scale along the other dim and are not
  measured separately. One outlier shrinks a tensorwise scale and flushes the rest towards 0.
- ``overflow``: the fraction of values that are non-finite or saturate (``|x| * scale > fp8_max``)
  at the scale from this layer's PREVIOUS sample of the same tensor (its per-tensor amax, for
  both recipes): the scale a delayed-scaling recipe would be using, and an early warning that the
  tensor's range jumped since the last sample. torchao's dynamic scaling takes the scale from the
  tensor itself and never saturates, so this is not saturation that happened in training. On a
  layer's first sample only non-finite values count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lossguard.agent.precision import quiet_cuda_kernel_warnings

TENSORS = ("input", "weight", "grad_output")
STATS = ("amax", "overflow", "underflow")
AMAX_EPS = 1e-12  # torchao's floor on amax before it divides by it


@dataclass(frozen=True)
class _Format:
    """How torchao casts one tensor: the FP8 dtype, per-row scales, power-of-2 scales."""

    dtype: torch.dtype
    rowwise: bool
    pow2: bool

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        """torchao's amax_to_scale: fp8_max / amax in float64, as float32, maybe rounded to 2^k."""
        scale = (self.max / amax.double().clamp(min=AMAX_EPS)).float()
        return torch.exp2(torch.floor(torch.log2(scale))) if self.pow2 else scale


@dataclass
class _Acc:
    """Running statistics of one tensor of one layer over the micro-batches of a sampled step."""

    amax: torch.Tensor
    overflow: torch.Tensor
    total: int
    underflow: torch.Tensor
    nonzero: torch.Tensor

    def add(self, other: _Acc) -> None:
        self.amax = torch.maximum(self.amax, other.amax)
        self.overflow = self.overflow + other.overflow
        self.total += other.total
        self.underflow = self.underflow + other.underflow
        self.nonzero = self.nonzero + other.nonzero


def _formats(config: Any) -> dict[str, _Format]:
    """The cast of each tensor under a Float8LinearConfig; tensors it leaves unscaled are absent."""
    from torchao.float8 import ScalingGranularity, ScalingType

    casts = {
        "input": config.cast_config_input,
        "weight": config.cast_config_weight,
        "grad_output": config.cast_config_grad_output,
    }
    return {
        name: _Format(
            dtype=cast.target_dtype,
            rowwise=cast.scaling_granularity is ScalingGranularity.AXISWISE,
            pow2=bool(config.round_scales_to_power_of_2),
        )
        for name, cast in casts.items()
        if cast.scaling_type is not ScalingType.DISABLED
    }


@torch.no_grad()
def _measure(x: torch.Tensor, fmt: _Format, prev_amax: torch.Tensor | None) -> _Acc:
    """Amax and overflow/underflow counts of one tensor, on its device, without a host read."""
    x = x.detach().float()
    mag = x.abs()
    amax = mag.amax()
    finite = torch.isfinite(x)
    row_amax = mag.amax(dim=-1, keepdim=True) if fmt.rowwise and x.dim() > 0 else amax
    nonzero = (x != 0) & finite
    flushed = (x * fmt.scale(row_amax)).to(fmt.dtype) == 0
    overflow = ~finite
    if prev_amax is not None:
        known = torch.isfinite(prev_amax)
        prev_scale = fmt.scale(torch.where(known, prev_amax, torch.ones_like(prev_amax)))
        overflow = overflow | ((mag * prev_scale > fmt.max) & known)
    return _Acc(
        amax=amax,
        overflow=overflow.sum(),
        total=x.numel(),
        underflow=(flushed & nonzero).sum(),
        nonzero=nonzero.sum(),
    )


def _worst(values: dict[str, float]) -> tuple[str, float]:
    """The layer with the largest value; NaN counts as the largest."""
    layer = max(values, key=lambda k: math.inf if math.isnan(values[k]) else values[k])
    return layer, values[layer]


class Fp8Health:
    """Samples amax and overflow/underflow ratios of every torchao Float8Linear in a model."""

    def __init__(self, model: nn.Module, recipe: str) -> None:
        device = next(model.parameters(), torch.empty(0)).device
        with quiet_cuda_kernel_warnings(device):
            from torchao.float8 import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear

        self.recipe = recipe
        default = Float8LinearConfig.from_recipe_name(recipe)
        self._modules: dict[str, nn.Module] = {
            fqn: m for fqn, m in model.named_modules() if isinstance(m, Float8Linear)
        }
        self._formats = {
            fqn: _formats(getattr(m, "config", default)) for fqn, m in self._modules.items()
        }
        self._handles: list[RemovableHandle] = []
        self._armed = False
        self._captured: dict[tuple[str, str], _Acc] = {}
        self._prev_amax: dict[tuple[str, str], torch.Tensor] = {}

    @property
    def layers(self) -> list[str]:
        """Fully qualified names of the Float8Linear layers watched."""
        return list(self._modules)

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> None:
        """Hook every Float8Linear for the coming forward and backward (no-op when armed)."""
        if self._armed:
            return
        self._armed = True
        for fqn, module in self._modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(fqn)))
            self._handles.append(module.register_full_backward_hook(self._backward_hook(fqn)))

    def disarm(self) -> None:
        """Remove the hooks and drop what they captured (e.g. when a sampled step fails)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured = {}
        self._armed = False

    def collect(self) -> dict[str, Any] | None:
        """Remove the hooks and return per-layer and worst-layer numbers; None if nothing ran."""
        if not self._armed:
            return None
        captured = self._captured
        self.disarm()
        if not captured:
            return None
        rows = []
        for key, acc in captured.items():
            overflow = acc.overflow.float() / max(acc.total, 1)
            underflow = acc.underflow.float() / acc.nonzero.clamp(min=1).float()
            rows.append(torch.stack([acc.amax, overflow, underflow]))
            prev = self._prev_amax.get(key, torch.full_like(acc.amax, math.nan))
            self._prev_amax[key] = torch.where(torch.isfinite(acc.amax), acc.amax, prev)
        device = rows[0].device
        values = torch.stack([row.to(device) for row in rows]).tolist()  # the one host read
        layers: dict[str, dict[str, dict[str, float]]] = {}
        for (fqn, tensor), row in zip(captured, values, strict=True):
            layers.setdefault(fqn, {})[tensor] = dict(zip(STATS, row, strict=True))
        return {"layers": layers, "worst": self._worst(layers)}

    @staticmethod
    def _worst(layers: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
        worst: dict[str, dict[str, Any]] = {}
        for tensor in TENSORS:
            for stat in STATS:
                values = {fqn: t[tensor][stat] for fqn, t in layers.items() if tensor in t}
                if values:
                    layer, value = _worst(values)
                    worst.setdefault(tensor, {})[stat] = value
                    worst[tensor][f"layer_{stat}"] = layer
        return worst

    def _record(self, fqn: str, tensor: str, x: torch.Tensor) -> None:
        fmt = self._formats[fqn].get(tensor)
        if fmt is None or not x.is_floating_point() or x.numel() == 0:
            return
        key = (fqn, tensor)
        acc = _measure(x, fmt, self._prev_amax.get(key))
        if key in self._captured:
            self._captured[key].add(acc)
        else:
            self._captured[key] = acc

    def _forward_hook(self, fqn: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if args and isinstance(args[0], torch.Tensor):
                self._record(fqn, "input", args[0])
            weight = module.weight
            # the same weight in every micro-batch of the step: measure it once
            if isinstance(weight, torch.Tensor) and (fqn, "weight") not in self._captured:
                self._record(fqn, "weight", weight)

        return hook

    def _backward_hook(self, fqn: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if grad_output and isinstance(grad_output[0], torch.Tensor):
                self._record(fqn, "grad_output", grad_output[0])

        return hook
