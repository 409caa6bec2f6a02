"""Peak FLOP/s resolution, memory stats and NVML sampling, with CUDA and NVML faked."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lossguard.agent.telemetry import hardware
from lossguard.agent.telemetry.hardware import (
    Nvml,
    Peak,
    measure_cpu_peak,
    memory_stats,
    resolve_peak,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
H100_SXM = ("NVIDIA H100 80GB HBM3", 85_520_809_984)


@pytest.fixture(autouse=True)
def fresh_caches() -> Iterator[None]:
    """Each test sees a process that has measured nothing and warned about nothing."""
    hardware._measured_cpu_peak.cache_clear()
    hardware._warn_no_peak.cache_clear()
    yield
    hardware._measured_cpu_peak.cache_clear()
    hardware._warn_no_peak.cache_clear()


def fake_cuda(monkeypatch: pytest.MonkeyPatch, name: str, total_memory: int) -> None:
    """Make torch report one CUDA GPU of this name and memory (the device queries only)."""
    props = SimpleNamespace(name=name, total_memory=total_memory, uuid="8f3a-0001")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


@contextlib.contextmanager
def cuda_matmul_flag(name: str, value: object) -> Iterator[None]:
    """Set a torch.backends.cuda.matmul flag for a block (monkeypatch cannot undo these)."""
    matmul = torch.backends.cuda.matmul
    saved = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def count_measurements(monkeypatch: pytest.MonkeyPatch, flops: float = 1e9) -> list[torch.dtype]:
    """Replace the CPU benchmark with a recorder of the dtypes it is asked to measure."""
    calls: list[torch.dtype] = []

    def fake_measure(dtype: torch.dtype = torch.float32) -> float:
        calls.append(dtype)
        return flops

    monkeypatch.setattr(hardware, "measure_cpu_peak", fake_measure)
    return calls


# ---------------------------------------------------------------- resolve_peak


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_override_wins(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    fake_cuda(monkeypatch, *H100_SXM)
    calls = count_measurements(monkeypatch)
    peak = resolve_peak(device, "bf16", override=123e12)
    assert peak == Peak(123e12, "config", "bf16", "cpu" if device.type == "cpu" else H100_SXM[0])
    assert calls == []


def test_cpu_peak_is_measured() -> None:
    peak = resolve_peak(CPU, "fp32", override=None)
    assert peak is not None
    assert (peak.source, peak.precision, peak.device) == ("measured", "fp32", "cpu")
    assert 1e8 < peak.flops < 1e14


def test_cpu_peak_is_measured_once_per_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_measurements(monkeypatch, flops=4.2e10)
    first = resolve_peak(CPU, "fp32", override=None)
    second = resolve_peak(CPU, "fp32", override=None)
    assert first == second == Peak(4.2e10, "measured", "fp32", "cpu")
    assert calls == [torch.float32]
    resolve_peak(CPU, "bf16", override=None)
    resolve_peak(CPU, "fp8", override=None)  # fp8 autocasts to bf16: already measured
    assert calls == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize(
    ("precision", "expected"),
    [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_cpu_peak_uses_the_autocast_dtype(
    monkeypatch: pytest.MonkeyPatch, precision: str, expected: torch.dtype
) -> None:
    calls = count_measurements(monkeypatch)
    peak = resolve_peak(CPU, precision, override=None)
    assert calls == [expected]
    assert peak is not None and peak.precision == precision


@pytest.mark.parametrize(("precision", "flops"), [("bf16", 989.4e12), ("fp8", 1978.9e12)])
def test_cuda_peak_from_table(
    monkeypatch: pytest.MonkeyPatch, precision: str, flops: float
) -> None:
    fake_cuda(monkeypatch, *H100_SXM)
    assert resolve_peak(CUDA, precision, override=None) == Peak(
        flops, "table", precision, "H100 SXM"
    )


@pytest.mark.parametrize(
    ("allow_tf32", "precision", "flops"), [(True, "tf32", 494.7e12), (False, "fp32", 67e12)]
)
def test_cuda_fp32_peak_follows_allow_tf32(
    monkeypatch: pytest.MonkeyPatch, allow_tf32: bool, precision: str, flops: float
) -> None:
    fake_cuda(monkeypatch, *H100_SXM)
    with cuda_matmul_flag("allow_tf32", allow_tf32):
        peak = resolve_peak(CUDA, "fp32", override=None)
    assert peak == Peak(flops, "table", precision, "H100 SXM")


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9")
def test_cuda_fp32_peak_follows_the_new_tf32_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set through fp32_precision, the legacy allow_tf32 flag raises when read."""
    fake_cuda(monkeypatch, *H100_SXM)
    with cuda_matmul_flag("fp32_precision", "tf32"):
        peak = resolve_peak(CUDA, "fp32", override=None)
    assert peak is not None and peak.precision == "tf32"


def test_unknown_gpu_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cuda(monkeypatch, "NVIDIA GeForce RTX 4090", 25_393_692_672)
    with caplog.at_level(logging.WARNING, logger="lossguard.agent"):
        assert resolve_peak(CUDA, "bf16", override=None) is None
        assert resolve_peak(CUDA, "bf16", override=None) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "NVIDIA GeForce RTX 4090" in message
    assert "MFU is off" in message and "telemetry.peak_flops" in message


def test_gpu_without_the_precision_gives_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cuda(monkeypatch, "NVIDIA A100-SXM4-80GB", 85_899_345_920)
    with caplog.at_level(logging.WARNING, logger="lossguard.agent"):
        assert resolve_peak(CUDA, "fp8", override=None) is None
    assert "fp8" in caplog.text and "A100" in caplog.text


# ---------------------------------------------------------------- measure_cpu_peak


def test_bench_size_shrinks_for_slow_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dtype whose 1024 matmul takes seconds is benchmarked small, so startup stays short."""
    slow = {128: 0.003, 256: 0.05, 512: 0.4, 1024: 3.0}
    fast = {128: 1e-4, 256: 8e-4, 512: 7e-3, 1024: 0.055}
    for table, expected in ((slow, 256), (fast, 1024)):
        monkeypatch.setattr(hardware, "_seconds_per_matmul", lambda n, dtype, t=table: t[n])
        assert hardware._bench_size(torch.float16, size=1024, min_seconds=0.3) == expected


def test_measure_cpu_peak_below_the_smallest_bench_size() -> None:
    flops = measure_cpu_peak(torch.float32, size=64, min_seconds=0.05)
    assert 1e7 < flops < 1e14


def test_measuring_the_cpu_peak_leaves_the_global_rng_alone() -> None:
    """How many matrices the benchmark draws depends on the machine's load: drawn from the
    global RNG, they would change a run's dropout masks and break bit-exact resume."""
    torch.manual_seed(1)
    before = torch.get_rng_state()
    measure_cpu_peak(torch.float32, size=256, min_seconds=0.05)
    assert torch.equal(torch.get_rng_state(), before)


# ---------------------------------------------------------------- memory_stats


def test_cpu_memory_stats() -> None:
    ballast = torch.ones(32 * 2**20, dtype=torch.uint8)  # 32 MiB, resident once written
    stats = memory_stats(CPU)
    assert set(stats) == {"allocated", "peak_allocated", "limit"}
    assert stats["allocated"] > ballast.numel()
    assert stats["peak_allocated"] >= stats["allocated"] * 0.9
    assert stats["limit"] > stats["allocated"]


def test_cuda_memory_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, *H100_SXM)
    allocator = {
        "allocated_bytes.all.current": 3 * 2**30,
        "reserved_bytes.all.current": 4 * 2**30,
        "allocated_bytes.all.peak": 5 * 2**30,
        "num_alloc_retries": 2,
        "num_ooms": 1,
    }
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: allocator)
    assert memory_stats(CUDA) == {
        "allocated": 3 * 2**30,
        "reserved": 4 * 2**30,
        "peak_allocated": 5 * 2**30,
        "limit": H100_SXM[1],
        "alloc_retries": 2,
        "ooms": 1,
    }


# ---------------------------------------------------------------- Nvml


class FakeNVMLError(Exception):
    pass


class FakePynvml:
    """Stands in for the pynvml module: fixed readings, one failing function on demand."""

    NVMLError = FakeNVMLError
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.calls: list[str] = []

    def _call(self, name: str, value: Any) -> Any:
        self.calls.append(name)
        if name == self.fail:
            raise FakeNVMLError(f"{name} failed")
        return value

    def nvmlInit(self) -> None:
        self._call("nvmlInit", None)

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown", None)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        return self._call("nvmlDeviceGetHandleByUUID", ("handle", uuid))

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        assert handle == ("handle", "GPU-8f3a-0001")
        return self._call("nvmlDeviceGetUtilizationRates", SimpleNamespace(gpu=87, memory=40))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetPowerUsage", 312_500))

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return int(self._call("nvmlDeviceGetTemperature", 64))

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        info = SimpleNamespace(used=30 * 2**30, total=80 * 2**30, free=50 * 2**30)
        return self._call("nvmlDeviceGetMemoryInfo", info)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetIndex", 3))

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return str(self._call("nvmlDeviceGetUUID", handle[1]))

    def nvmlDeviceGetName(self, handle: Any) -> bytes:  # bytes before nvidia-ml-py 11.515
        return bytes(self._call("nvmlDeviceGetName", b"NVIDIA H100 80GB HBM3"))


@pytest.fixture
def pynvml(monkeypatch: pytest.MonkeyPatch) -> FakePynvml:
    fake = FakePynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    fake_cuda(monkeypatch, *H100_SXM)
    return fake


def assert_unavailable(nvml: Nvml) -> None:
    assert not nvml.available
    assert nvml.sample() is None
    nvml.close()


def test_nvml_absent_without_pynvml(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with caplog.at_level(logging.DEBUG, logger="lossguard.agent"):
        assert_unavailable(Nvml(CUDA))
    assert len(caplog.records) == 1
    assert caplog.records[0].levelno == logging.DEBUG


def test_nvml_absent_without_driver(pynvml: FakePynvml) -> None:
    pynvml.fail = "nvmlInit"
    assert_unavailable(Nvml(CUDA))
    assert pynvml.calls == ["nvmlInit"]


def test_nvml_absent_without_handle_shuts_down(pynvml: FakePynvml) -> None:
    pynvml.fail = "nvmlDeviceGetHandleByUUID"
    assert_unavailable(Nvml(CUDA))
    assert pynvml.calls == ["nvmlInit", "nvmlDeviceGetHandleByUUID", "nvmlShutdown"]


def test_nvml_absent_on_cpu(pynvml: FakePynvml) -> None:
    assert_unavailable(Nvml(CPU))
    assert pynvml.calls == []


def test_nvml_sample(pynvml: FakePynvml) -> None:
    nvml = Nvml(CUDA)
    assert nvml.available
    assert nvml.sample() == {
        "utilization_ratio": 0.87,
        "power_watts": 312.5,
        "temperature_celsius": 64.0,
        "memory_used_bytes": 30 * 2**30,
        "memory_total_bytes": 80 * 2**30,
    }
    nvml.close()
    nvml.close()
    assert pynvml.calls.count("nvmlShutdown") == 1
    assert_unavailable(nvml)


def test_nvml_error_during_sample(pynvml: FakePynvml, caplog: pytest.LogCaptureFixture) -> None:
    nvml = Nvml(CUDA)
    pynvml.fail = "nvmlDeviceGetPowerUsage"
    with caplog.at_level(logging.DEBUG, logger="lossguard.agent"):
        assert nvml.sample() is None
        assert nvml.sample() is None
    assert len(caplog.records) == 1
    pynvml.fail = None
    sample = nvml.sample()
    assert sample is not None and sample["power_watts"] == 312.5
    assert nvml.available
    nvml.close()


def test_nvml_identity_is_dcgm_s_labels(pynvml: FakePynvml) -> None:
    nvml = Nvml(CUDA)
    assert nvml.identity() == {
        "gpu": "3",  # NVML's index, as DCGM's `gpu` label, whatever CUDA_VISIBLE_DEVICES says
        "UUID": "GPU-8f3a-0001",
        "modelName": "NVIDIA H100 80GB HBM3",
    }
    pynvml.fail = "nvmlDeviceGetUUID"
    assert nvml.identity() is None
    nvml.close()
    assert nvml.identity() is None
    assert Nvml(CPU).identity() is None
