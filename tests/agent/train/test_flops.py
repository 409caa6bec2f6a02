"""FLOPs per token, training precision to matmul precision, and the GPU peak table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lossguard.agent.config import ModelConfig
from lossguard.agent.telemetry.gpu_peaks import PRECISIONS, lookup_gpu, matmul_precision
from lossguard.agent.train.flops import flops_per_token
from lossguard.agent.train.model import GPT

pytestmark = pytest.mark.live

GB = 10**9
# Device name, total memory as torch reports it, the table row it must resolve to.
KNOWN_GPUS = [
    ("NVIDIA H100 80GB HBM3", 85 * GB, "H100 SXM"),
    ("NVIDIA H100 PCIe", 85 * GB, "H100 PCIe"),
    ("NVIDIA H100 NVL", 100 * GB, "H100 NVL"),
    ("NVIDIA H100", 100 * GB, "H100 NVL"),  # a bare name with 94 GB: only the NVL has that
    ("NVIDIA H200", 150 * GB, "H200 SXM"),
    ("NVIDIA H200 NVL", 150 * GB, "H200 NVL"),
    ("NVIDIA A100-SXM4-80GB", 85 * GB, "A100"),
    ("NVIDIA A100-SXM4-40GB", 42 * GB, "A100"),
    ("NVIDIA A100-PCIE-40GB", 42 * GB, "A100"),
    ("NVIDIA A100 80GB PCIe", 85 * GB, "A100"),
    ("NVIDIA L4", 24 * GB, "L4"),
    ("NVIDIA L40", 48 * GB, "L40"),
    ("NVIDIA L40S", 48 * GB, "L40S"),
    ("NVIDIA A10", 24 * GB, "A10"),
    ("NVIDIA B200", 190 * GB, "B200"),
]
UNKNOWN_GPUS = [
    ("NVIDIA GeForce RTX 4090", 24 * GB),
    ("Tesla T4", 16 * GB),
    ("NVIDIA A10G", 24 * GB),  # AWS's A10 variant: other clocks, not in the table
    ("NVIDIA GB200", 190 * GB),  # contains "B200" but is another part
    ("NVIDIA H100", 85 * GB),  # bare name at 80 GB: SXM or PCIe, no way to tell
    ("NVIDIA H800", 85 * GB),
]


def test_flops_per_token_gpt2_small() -> None:
    # GPT-2 124M: N = wte 50257*768 + 12 blocks * (12*768^2 + 13*768) + ln_f 2*768.
    n = 50257 * 768 + 12 * (12 * 768**2 + 13 * 768) + 2 * 768
    assert n == 123_653_376
    assert flops_per_token(n, n_layer=12, n_head=12, head_dim=64, seq_len=1024) == (
        6 * 123_653_376 + 12 * 12 * 12 * 64 * 1024
    )


def test_gpt_num_params_is_the_documented_n() -> None:
    """N = every parameter but the position embedding, the tied token embedding included."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    model = GPT(cfg, vocab_size=100)
    c = cfg.n_embd
    assert model.num_params() == 100 * c + 2 * (12 * c * c + 13 * c) + 2 * c


@pytest.mark.parametrize(
    ("dtype", "allow_tf32", "expected"),
    [
        ("fp32", False, "fp32"),
        ("fp32", True, "tf32"),
        ("bf16", True, "bf16"),
        ("fp16", False, "fp16"),
        ("fp8", True, "fp8"),
    ],
)
def test_matmul_precision(dtype: str, allow_tf32: bool, expected: str) -> None:
    assert matmul_precision(dtype, allow_tf32) == expected


def test_matmul_precision_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="fp64"):
        matmul_precision("fp64", allow_tf32=False)


@pytest.mark.parametrize(("device_name", "memory", "spec_name"), KNOWN_GPUS)
def test_lookup_gpu_known(device_name: str, memory: int, spec_name: str) -> None:
    spec = lookup_gpu(device_name, memory)
    assert spec is not None
    assert spec.name == spec_name


@pytest.mark.parametrize(("device_name", "memory"), UNKNOWN_GPUS)
def test_lookup_gpu_unknown_is_none(device_name: str, memory: int) -> None:
    assert lookup_gpu(device_name, memory) is None


@pytest.mark.parametrize(("device_name", "memory", "spec_name"), KNOWN_GPUS)
def test_peaks_are_ordered(device_name: str, memory: int, spec_name: str) -> None:
    spec = lookup_gpu(device_name, memory)
    assert spec is not None
    peaks = spec.peaks
    assert set(peaks) <= set(PRECISIONS)
    assert peaks["bf16"] == peaks["fp16"] >= peaks["tf32"] >= peaks["fp32"] > 1e12
    if "fp8" in peaks:  # the L40S datasheet prints 733 TF FP8 against 362.05 TF BF16
        assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=0.02)


@pytest.mark.parametrize(
    ("device_name", "memory", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 85 * GB, "bf16", 989.4e12),
        ("NVIDIA H100 80GB HBM3", 85 * GB, "fp8", 1978.9e12),
        ("NVIDIA H100 80GB HBM3", 85 * GB, "tf32", 494.7e12),
        ("NVIDIA H100 80GB HBM3", 85 * GB, "fp32", 67e12),
        ("NVIDIA H100 PCIe", 85 * GB, "bf16", 756e12),
        ("NVIDIA H100 NVL", 100 * GB, "bf16", 835.5e12),
        ("NVIDIA H200", 150 * GB, "bf16", 989.4e12),
        ("NVIDIA H200 NVL", 150 * GB, "fp8", 1670.5e12),
        ("NVIDIA A100-SXM4-80GB", 85 * GB, "tf32", 156e12),
        ("NVIDIA A10", 24 * GB, "bf16", 125e12),
        ("NVIDIA L40S", 48 * GB, "fp8", 733e12),
        ("NVIDIA B200", 190 * GB, "bf16", 2.25e15),
    ],
)
def test_datasheet_values(device_name: str, memory: int, precision: str, peak: float) -> None:
    spec = lookup_gpu(device_name, memory)
    assert spec is not None
    assert spec.peaks[precision] == peak


@pytest.mark.parametrize("device_name", ["NVIDIA A100-SXM4-80GB", "NVIDIA A10"])
def test_no_fp8_entry_without_fp8_tensor_cores(device_name: str) -> None:
    spec = lookup_gpu(device_name, 85 * GB)
    assert spec is not None
    assert "fp8" not in spec.peaks


def test_flops_module_is_torch_free() -> None:
    code = (
        "import sys, lossguard.agent.train.flops, lossguard.agent.telemetry.gpu_peaks\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
