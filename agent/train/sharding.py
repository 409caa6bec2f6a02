"""FSDP2 and HSDP for the built-in trainer: the device mesh, ``fully_shard`` per transformer
block and at the root, the bf16 mixed-precision policy, activation checkpointing and
``torch.compile`` per block."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn import Module

from lossguard.agent.config import DistributedConfig
from lossguard.agent.train.model import GPT
from lossguard.common.config import ConfigError

LOW_PRECISION = frozenset({"bf16", "fp8"})
"""Precisions whose parameters FSDP2 all-gathers in bf16 (reductions stay fp32)."""


def device_mesh(cfg: DistributedConfig, world_size: int, device: torch.device) -> DeviceMesh:
    """fsdp2: one dimension over every rank; hsdp: (replicate, shard). ConfigError when the
    world size does not divide into ``replicate`` groups."""
    if cfg.strategy == "hsdp":
        replicate = int(cfg.replicate or 1)
        if world_size % replicate:
            raise ConfigError(
                f"distributed.replicate: {world_size} ranks do not divide into "
                f"{replicate} replica groups"
            )
        return init_device_mesh(
            device.type, (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """bf16 parameters in forward and backward, fp32 gradient reductions; fp32 otherwise."""
    if dtype in LOW_PRECISION:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_gpt(
    model: GPT,
    cfg: DistributedConfig,
    dtype: str,
    mesh: DeviceMesh,
    *,
    compile_backend: str | None = None,
) -> None:
    """Shard ``model`` in place: each block (wrapped for activation checkpointing if asked;
    its forward compiled with ``compile_backend`` if given), then the root (embeddings, final
    norm, tied head).

    As torchtitan does, each block's forward is compiled whole (``fullgraph``) before the block
    is sharded: FSDP2's all-gather and reduce-scatter hooks stay outside the compiled graph, the
    blocks share one graph, and parameter names do not change (checkpoints and per-layer
    metrics read the same names as in eager runs)."""
    policy = mixed_precision(dtype)
    for index, block in enumerate(model.blocks):
        if cfg.activation_checkpointing:
            block = checkpoint_wrapper(block)
            model.blocks[index] = block
        if compile_backend is not None:
            block.forward = torch.compile(block.forward, backend=compile_backend, fullgraph=True)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def gradient_sync(model: Module, last_micro_batch: bool) -> None:
    """Under FSDP2, reduce-scatter gradients on the last micro-batch of a step only."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last_micro_batch)
