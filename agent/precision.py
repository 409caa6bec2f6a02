"""Numeric precision: autocast, the fp16 GradScaler, and FP8 training through torchao."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch
from torch import nn

from lossguard.agent.config import PrecisionConfig
from lossguard.common.config import ConfigError

# Autocast dtype per precision; FP8 layers run their matmuls in float8 and the rest in bf16.
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}
FP8_MIN_CAPABILITY = (8, 9)
FP8_DIM_MULTIPLE = 16
FP8_EXCLUDED_MODULES = frozenset({"lm_head"})


class PrecisionError(ConfigError):
    """The requested precision cannot run on this device."""


@contextlib.contextmanager
def autocast(dtype: str, device: torch.device) -> Iterator[None]:
    """Autocast for the configured precision (a no-op for fp32)."""
    amp_dtype = AUTOCAST_DTYPES[dtype]
    if amp_dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=amp_dtype):
        yield


def make_grad_scaler(dtype: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16, none otherwise."""
    return torch.amp.GradScaler(device.type) if dtype == "fp16" else None


def check_fp8_supported(device: torch.device) -> None:
    """Stop at start, clearly, on a CUDA GPU without FP8 tensor cores (below sm_89)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise PrecisionError(
            f"precision.dtype: fp8 needs a GPU of compute capability 8.9 or newer "
            f"(Ada, Hopper, Blackwell); {name} is {capability[0]}.{capability[1]}: "
            f"use bf16 on this GPU"
        )


@contextlib.contextmanager
def quiet_cuda_kernel_warnings(device: torch.device) -> Iterator[None]:
    """On CPU, torchao's import warns that its CUDA kernels cannot load: true and irrelevant."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    if device.type == "cpu":
        for logger in loggers:
            logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def is_fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """Linear layers whose dimensions FP8 kernels accept; never the output head."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in FP8_EXCLUDED_MODULES:
        return False
    return module.in_features % FP8_DIM_MULTIPLE == 0 and (
        module.out_features % FP8_DIM_MULTIPLE == 0
    )


def fp8_all_gather(cfg: PrecisionConfig, device: torch.device, sharded: bool) -> bool:
    """FSDP2 all-gathers FP8 weights (half the bytes of bf16): on GPUs, tensorwise scaling."""
    return sharded and device.type == "cuda" and cfg.fp8_recipe == "tensorwise"


def convert_to_fp8(
    model: nn.Module, cfg: PrecisionConfig, device: torch.device, *, all_gather: bool = False
) -> int:
    """Swap eligible nn.Linear layers for torchao Float8Linear; returns how many were swapped.
    ``all_gather`` (``fp8_all_gather``): FSDP2 gathers the weights in FP8."""
    check_fp8_supported(device)
    with quiet_cuda_kernel_warnings(device):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe)
    if device.type == "cpu":
        # no FP8 hardware: the casts, scales and saturation are FP8's, the GEMM runs in fp32 on
        # the dequantized values (torch's own CPU _scaled_mm is a reference loop, ~100x slower)
        config = dataclasses.replace(config, emulate=True)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=is_fp8_eligible)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def precompute_fp8_scales(model: nn.Module) -> None:
    """After the optimizer step, with FP8 all-gather: every FP8 weight's scale in one
    all-reduce, instead of one per layer inside the next forward."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
