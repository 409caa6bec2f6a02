"""Device facts for telemetry: the peak FLOP/s behind MFU, memory use, and NVML readings."""

from __future__ import annotations

import functools
import logging
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from lossguard.agent.precision import AUTOCAST_DTYPES
from lossguard.agent.telemetry.gpu_peaks import lookup_gpu, matmul_precision

log = logging.getLogger("lossguard.agent")

MIN_BENCH_SIZE = 128
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Peak:
    """A peak FLOP/s, where it came from, and the matmul precision it is for.

    ``device`` is the table's GPU model ("H100 SXM") for a table peak, else the device's name.
    """

    flops: float
    source: Literal["table", "measured", "config"]
    precision: str
    device: str


def _operands(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random n x n matrices from a private generator: how many a benchmark draws depends
    on the machine's load, so drawing them from torch's global RNG would change the training
    run's dropout masks and break bit-exact resume and rollback."""
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randn(n, n, dtype=dtype, generator=generator),
        torch.randn(n, n, dtype=dtype, generator=generator),
    )


def _seconds_per_matmul(n: int, dtype: torch.dtype) -> float:
    """Wall time of one n x n matmul: the fastest of three after a setup call (other load on
    the machine only ever slows a matmul down)."""
    a, b = _operands(n, dtype)
    torch.mm(a, b)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return min(times)


def _bench_size(dtype: torch.dtype, size: int, min_seconds: float) -> int:
    """Matrix side for the benchmark: doubled from 128 up to ``size`` while the next size's
    matmul (8x the work) would take at most a quarter of ``min_seconds``.

    A dtype without fast CPU kernels (fp16 on most CPUs: seconds per 1024 matmul) stays small.
    """
    n = min(MIN_BENCH_SIZE, size)
    while n < size and 8 * _seconds_per_matmul(n, dtype) <= min_seconds / 4:
        n = min(2 * n, size)
    return n


def measure_cpu_peak(
    dtype: torch.dtype = torch.float32, size: int = 1024, min_seconds: float = 0.3
) -> float:
    """Peak FLOP/s (2n^3 per matmul) of n x n matmuls, n <= ``size``: the fastest single
    matmul over at least ``min_seconds`` after a warm-up. Other load on a shared machine only
    slows matmuls down, so the fastest one is the best estimate of the peak."""
    n = _bench_size(dtype, size, min_seconds)
    a, b = _operands(n, dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up
    fastest = math.inf
    deadline = time.perf_counter() + min_seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        end = time.perf_counter()
        fastest = min(fastest, end - start)
        if end >= deadline:
            return 2.0 * n**3 / fastest


@functools.cache
def _measured_cpu_peak(dtype: torch.dtype) -> float:
    """The CPU peak of a dtype, measured once per process."""
    return measure_cpu_peak(dtype)


@functools.cache
def _warn_no_peak(gpu: str, precision: str) -> None:
    """Say once per process that MFU is off for want of a peak."""
    log.warning(
        "no %s peak FLOP/s known for %s: MFU is off (set telemetry.peak_flops to enable it)",
        precision,
        gpu,
    )


def _cpu_matmul_dtype(precision: str) -> torch.dtype:
    """The dtype a CPU peak is measured in: the precision's autocast dtype."""
    return AUTOCAST_DTYPES[precision] or torch.float32


def _tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA run on TF32 tensor cores.

    torch >= 2.9's ``fp32_precision`` follows both APIs; its legacy ``allow_tf32`` raises once
    the new API has been used, so it is read only on older versions.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    return precision == "tf32" if precision is not None else bool(matmul.allow_tf32)


def _device_precision(device: torch.device, precision: str) -> str:
    """The matmul precision of a training precision on this device (CPUs have no TF32)."""
    if device.type == "cuda":
        return matmul_precision(precision, _tf32_matmuls())
    return _DTYPE_NAMES[_cpu_matmul_dtype(precision)]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _table_peak(device: torch.device, precision: str) -> Peak | None:
    """The datasheet peak of this GPU, or None (and one warning) if the table has none."""
    name = torch.cuda.get_device_name(device)
    spec = lookup_gpu(name, torch.cuda.get_device_properties(device).total_memory)
    if spec is None or precision not in spec.peaks:
        _warn_no_peak(name, precision)
        return None
    return Peak(spec.peaks[precision], "table", precision, spec.name)


def resolve_peak(device: torch.device, precision: str, override: float | None) -> Peak | None:
    """The peak MFU is measured against: the configured override, the GPU table, or a CPU benchmark.

    ``precision`` is config precision.dtype. On CUDA a GPU missing from the table gives None; on
    CPU the peak is measured in the precision's autocast dtype, once per process.
    """
    matmul = _device_precision(device, precision)
    if override is not None:
        return Peak(override, "config", matmul, _device_name(device))
    if device.type == "cuda":
        return _table_peak(device, matmul)
    return Peak(_measured_cpu_peak(_cpu_matmul_dtype(precision)), "measured", matmul, "cpu")


def _cuda_memory_stats(device: torch.device) -> dict[str, float]:
    stats = torch.cuda.memory_stats(device)
    return {
        "allocated": float(stats.get("allocated_bytes.all.current", 0)),
        "reserved": float(stats.get("reserved_bytes.all.current", 0)),
        "peak_allocated": float(stats.get("allocated_bytes.all.peak", 0)),
        "limit": float(torch.cuda.get_device_properties(device).total_memory),
        "alloc_retries": float(stats.get("num_alloc_retries", 0)),
        "ooms": float(stats.get("num_ooms", 0)),
    }


def _peak_rss_bytes() -> float:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(maxrss if sys.platform == "darwin" else maxrss * 1024)


def _rss_bytes() -> float:
    """Current resident set size from /proc; the peak where there is no /proc."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except OSError:
        return _peak_rss_bytes()
    return float(resident_pages * os.sysconf("SC_PAGE_SIZE"))


def _cpu_memory_stats() -> dict[str, float]:
    rss = _rss_bytes()  # peak RSS is counted in KiB, RSS in pages: keep peak >= current
    return {
        "allocated": rss,
        "peak_allocated": max(rss, _peak_rss_bytes()),
        "limit": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
    }


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in bytes: the CUDA caching allocator's view, or this process's RSS on CPU.

    CUDA: allocated, reserved, peak_allocated, limit, alloc_retries, ooms.
    CPU: allocated (RSS), peak_allocated (peak RSS), limit (physical memory).
    """
    return _cuda_memory_stats(device) if device.type == "cuda" else _cpu_memory_stats()


class Nvml:
    """GPU utilisation, power, temperature and memory from NVML (the nvidia-ml-py package).

    Absent cleanly, with one debug message: no pynvml, no driver, or not a CUDA device give
    ``available = False`` and ``sample() -> None``. The GPU is found by UUID, so the handle is
    the right one whatever CUDA_VISIBLE_DEVICES renumbers.
    """

    def __init__(self, device: torch.device) -> None:
        self._nvml: ModuleType | None = None
        self._handle: Any = None
        self._sample_failed = False
        if device.type != "cuda":
            log.debug("NVML off: %s is not a CUDA device", device)
            return
        try:
            import pynvml
        except ImportError:
            log.debug("NVML off: nvidia-ml-py is not installed")
            return
        self._open(pynvml, device)

    def _open(self, pynvml: ModuleType, device: torch.device) -> None:
        """Initialise NVML and find the handle of ``device``; stay unavailable on any NVML error."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            log.debug("NVML off: %s", exc)
            return
        uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError as exc:
            log.debug("NVML off: no handle for %s: %s", uuid, exc)
            _shutdown(pynvml)
            return
        self._nvml = pynvml

    @property
    def available(self) -> bool:
        """Whether NVML is initialised with a handle on this device."""
        return self._nvml is not None

    def identity(self) -> dict[str, str] | None:
        """The GPU as DCGM's exporter labels it: ``gpu`` (NVML's index, not CUDA's), ``UUID``
        and ``modelName``; None where NVML is absent or a query fails."""
        if self._nvml is None:
            return None
        nvml, handle = self._nvml, self._handle
        try:
            found = {
                "gpu": nvml.nvmlDeviceGetIndex(handle),
                "UUID": nvml.nvmlDeviceGetUUID(handle),
                "modelName": nvml.nvmlDeviceGetName(handle),
            }
        except nvml.NVMLError as exc:
            log.debug("NVML identity failed: %s", exc)
            return None
        return {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in found.items()}

    def sample(self) -> dict[str, float] | None:
        """Current readings, or None where NVML is absent or a query fails."""
        if self._nvml is None:
            return None
        nvml, handle = self._nvml, self._handle
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            return {
                "utilization_ratio": nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
                "power_watts": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                "temperature_celsius": float(
                    nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
                ),
                "memory_used_bytes": float(memory.used),
                "memory_total_bytes": float(memory.total),
            }
        except nvml.NVMLError as exc:
            if not self._sample_failed:
                log.debug("NVML sample failed (logged once): %s", exc)
                self._sample_failed = True
            return None

    def close(self) -> None:
        """Shut NVML down if this object initialised it."""
        if self._nvml is not None:
            _shutdown(self._nvml)
            self._nvml = None


def _shutdown(nvml: ModuleType) -> None:
    """nvmlShutdown, where a failure only matters to a debugger."""
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as exc:
        log.debug("NVML shutdown failed: %s", exc)


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
