"""Copies of training state for async saves, taken off the device before training goes on."""

from __future__ import annotations

import copy
from typing import Any

import torch


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` for an async save: tensors become detached contiguous CPU clones.

    dicts, lists and tuples are copied recursively and keep their types; other values are
    returned as they are. CUDA tensors are copied without blocking into pinned memory, then
    each CUDA device seen is synchronised once.
    """
    cuda_devices: set[torch.device] = set()
    copied = _copy(obj, cuda_devices)
    for device in cuda_devices:
        torch.cuda.synchronize(device)
    return copied


def _copy(obj: Any, cuda_devices: set[torch.device]) -> Any:
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj, cuda_devices)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type and attributes such as a state dict's _metadata
        for key, value in obj.items():
            out[key] = _copy(value, cuda_devices)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_copy(value, cuda_devices) for value in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _copy_tensor(tensor: torch.Tensor, cuda_devices: set[torch.device]) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor.to("cpu", memory_format=torch.contiguous_format, copy=True)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    cuda_devices.add(tensor.device)
    return out
