"""The dense peak FLOP/s of datacenter GPUs per matmul precision: what MFU is taken against.

Torch-free. Peaks are dense (no 2:4 sparsity): NVIDIA datasheets quote tensor-core figures "with
sparsity", so those are halved here. An unknown GPU has no peak: MFU against a guessed peak would
be a confident wrong number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
# Past this much memory an "H100" without a form factor in its name is the 94 GB NVL.
H100_NVL_MIN_BYTES = 90 * 2**30


def matmul_precision(dtype: str, allow_tf32: bool) -> str:
    """The matmul precision whose peak applies to a training precision (config precision.dtype).

    fp32 matmuls run on TF32 tensor cores when torch allows it; fp8 training is rated against the
    FP8 peak although its non-linear layers run in bf16.
    """
    if dtype == "fp32":
        return "tf32" if allow_tf32 else "fp32"
    if dtype in ("bf16", "fp16", "fp8"):
        return dtype
    raise ValueError(f"unknown precision {dtype!r}: expected fp32, bf16, fp16 or fp8")


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model and its dense peak FLOP/s per matmul precision (no entry: not supported)."""

    name: str
    peaks: dict[str, float]


def _peaks(fp32: float, tf32: float, half: float, fp8: float | None = None) -> dict[str, float]:
    """Peaks per precision; bf16 and fp16 share the half-precision tensor-core rate."""
    peaks = {"fp32": fp32, "tf32": tf32, "bf16": half, "fp16": half}
    return peaks if fp8 is None else {**peaks, "fp8": fp8}


_SPECS = {
    spec.name: spec
    for spec in (
        # H100 datasheet (SXM5): FP32 67 TF; TF32 989, BF16/FP16 1979, FP8 3958 TF sparse; the
        # whitepaper's exact dense figures are 494.7 / 989.4 / 1978.9.
        GpuSpec("H100 SXM", _peaks(67e12, 494.7e12, 989.4e12, 1978.9e12)),
        # H100 datasheet (PCIe): FP32 51 TF; TF32 756, BF16/FP16 1513, FP8 3026 TF sparse.
        GpuSpec("H100 PCIe", _peaks(51e12, 378e12, 756e12, 1513e12)),
        # H100 datasheet (NVL, per GPU): FP32 60 TF; TF32 835, BF16/FP16 1671, FP8 3341 TF sparse.
        GpuSpec("H100 NVL", _peaks(60e12, 417.5e12, 835.5e12, 1670.5e12)),
        # H200 datasheet (SXM): the H100 SXM figures (FP32 67; TF32 989, BF16 1979, FP8 3958).
        GpuSpec("H200 SXM", _peaks(67e12, 494.7e12, 989.4e12, 1978.9e12)),
        # H200 datasheet (NVL): the H100 NVL figures (FP32 60; TF32 835, BF16 1671, FP8 3341).
        GpuSpec("H200 NVL", _peaks(60e12, 417.5e12, 835.5e12, 1670.5e12)),
        # A100 datasheet, SXM and PCIe, 40 and 80 GB alike: FP32 19.5 TF; TF32 156, BF16/FP16
        # 312 TF dense (312 / 624 sparse). No FP8 tensor cores.
        GpuSpec("A100", _peaks(19.5e12, 156e12, 312e12)),
        # A10 datasheet: FP32 31.2 TF; TF32 62.5, BF16/FP16 125 TF dense (125 / 250 sparse).
        GpuSpec("A10", _peaks(31.2e12, 62.5e12, 125e12)),
        # L4 datasheet: FP32 30.3 TF; TF32 120, BF16/FP16 242, FP8 485 TF sparse.
        GpuSpec("L4", _peaks(30.3e12, 60e12, 121e12, 242.5e12)),
        # L40 datasheet: FP32 90.5 TF; TF32 90.5, BF16/FP16 181.05, FP8 362 TF dense.
        GpuSpec("L40", _peaks(90.5e12, 90.5e12, 181.05e12, 362e12)),
        # L40S datasheet: FP32 91.6 TF; TF32 183, BF16/FP16 362.05, FP8 733 TF dense (as printed:
        # FP8 is 2.02x BF16 there).
        GpuSpec("L40S", _peaks(91.6e12, 183e12, 362.05e12, 733e12)),
        # HGX B200 datasheet (per GPU, 1000 W): FP32 75 TF; TF32 2.2, BF16/FP16 4.5, FP8 9 PF
        # sparse. (80 TF FP32 is the GB200 figure; that GPU reports itself as "GB200".)
        GpuSpec("B200", _peaks(75e12, 1.1e15, 2.25e15, 4.5e15)),
    )
}


def _name_tokens(device_name: str) -> set[str]:
    """Upper-case words of a device name: "NVIDIA A100-SXM4-80GB" -> {NVIDIA, A100, SXM4, 80GB}."""
    return set(re.split(r"[^A-Z0-9]+", device_name.upper()))


def _h100_variant(tokens: set[str], memory_bytes: int) -> str | None:
    """SXM, PCIe or NVL from the name, or from memory size (94 GB: NVL) where the name is bare."""
    if "NVL" in tokens:
        return "H100 NVL"
    if "PCIE" in tokens:
        return "H100 PCIe"
    if "HBM3" in tokens or any(token.startswith("SXM") for token in tokens):
        return "H100 SXM"
    return "H100 NVL" if memory_bytes > H100_NVL_MIN_BYTES else None


def _spec_name(tokens: set[str], memory_bytes: int) -> str | None:
    """The table row for a device, by whole words of its name so "A10" never matches "A100"."""
    if "H100" in tokens:
        return _h100_variant(tokens, memory_bytes)
    if "H200" in tokens:
        return "H200 NVL" if "NVL" in tokens else "H200 SXM"
    return next(
        (name for name in ("A100", "A10", "L4", "L40", "L40S", "B200") if name in tokens), None
    )


def lookup_gpu(device_name: str, memory_bytes: int) -> GpuSpec | None:
    """The spec of a GPU named as ``torch.cuda.get_device_name`` reports it; None if unknown."""
    name = _spec_name(_name_tokens(device_name), memory_bytes)
    return None if name is None else _SPECS[name]
