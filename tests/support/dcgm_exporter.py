"""A stand-in for NVIDIA's DCGM exporter (this machine has no GPU): the metric names and labels
its documentation shows (``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``,
``DCGM_FI_DRIVER_VERSION``), one series per GPU, served over HTTP by :class:`ExpositionServer`."""

from __future__ import annotations

from collections.abc import Sequence

MODEL = "NVIDIA H100 80GB HBM3"
IDENTITY = {"gpu": "0", "UUID": "GPU-5e1f3c2a-7b44-4d0e-9a61-0c2f8e9d1a77", "modelName": MODEL}
"""The GPU of tests/support/fake_gpu_agent.py, as NVML would name it."""
DRIVER = "550.54.15"
FIELDS = {
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %).", 97.0),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB).", 61234.0),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W).", 612.5),
    "DCGM_FI_DEV_GPU_TEMP": ("gauge", "GPU temperature (in C).", 64.0),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered.", 0.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
        0.42,
    ),
}


def dcgm_exposition(hostname: str, uuids: Sequence[str]) -> str:
    """The exporter's ``/metrics`` for the GPUs ``uuids`` (indexes 0, 1, ...) of ``hostname``."""
    lines = []
    for name, (kind, help_text, value) in FIELDS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for index, uuid in enumerate(uuids):
            labels = (
                f'gpu="{index}",UUID="{uuid}",device="nvidia{index}",modelName="{MODEL}",'
                f'Hostname="{hostname}",DCGM_FI_DRIVER_VERSION="{DRIVER}"'
            )
            lines.append(f"{name}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"
