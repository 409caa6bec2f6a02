"""Sharded (DTensor) values, made whole on the device: FSDP2 / HSDP models hold DTensor
parameters and gradients; a norm over them is a DTensor whose full value needs one collective."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from lossguard.agent.distributed import collective

__all__ = ["DTensor", "full_value", "is_sharded", "reduce_shard_stats", "shard_stats"]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (``fully_shard``, FSDP2 / HSDP)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value on every rank (one collective on its device, no host sync);
    a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_stats(grad: DTensor, neuron_rows: bool) -> tuple[torch.Tensor, float]:
    """This rank's part of a gradient's statistics: sum of squares, max |g|, all-zero rows and
    rows (rows: for a Linear weight, sharded by rows under FSDP2; else 0), and how many ranks
    hold the same shard (the replicas of HSDP), by which the sums are divided."""
    local = grad.to_local().detach()
    if local.numel() == 0:
        zero = torch.zeros((), device=local.device)
        stats = torch.stack([zero, zero, zero, zero])
    else:
        squares = local.float().square().sum()
        gmax = local.abs().amax().float()
        dead = (local == 0).all(dim=1).float().sum() if neuron_rows else squares * 0
        rows = torch.full_like(squares, float(local.shape[0]) if neuron_rows else 0.0)
        stats = torch.stack([squares, gmax, dead, rows])
    replicas = 1
    for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
        if isinstance(placement, Replicate):
            replicas *= size
    return stats, float(replicas)


def reduce_shard_stats(stats: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """Every parameter's [L2, max |g|, dead fraction] over all ranks' shards: two collectives
    on the device (a sum and a max), whatever the number of parameters."""
    local = torch.stack([s for s, _ in stats])
    replicas = torch.tensor([r for _, r in stats], device=local.device).unsqueeze(1)
    sums = local[:, [0, 2, 3]] / replicas
    maxima = local[:, 1].clone()
    if dist.is_initialized():
        with collective("all_reduce: sharded gradient statistics"):
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    dead = torch.where(sums[:, 2] > 0, sums[:, 1] / sums[:, 2].clamp(min=1), 0.0)
    return torch.stack([sums[:, 0].sqrt(), maxima, dead], dim=1)
