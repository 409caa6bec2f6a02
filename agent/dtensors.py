"""Sharded (DTensor) values, made whole on the device: FSDP2 / HSDP models hold DTensor
parameters and gradients; a norm over them is a DTensor whose full value needs one collective."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (``fully_shard``, FSDP2 / HSDP)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value on every rank (one collective on its device, no host sync);
    a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
