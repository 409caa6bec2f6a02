"""Which sharded models a callback can guard: FSDP2 / HSDP, whose parameters are DTensors on
one device mesh (Guard takes the gradient norm over their shards and checkpoints them with
DCP), or no sharding at all. Anything else is refused when training starts, in one line."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor


def refuse_unguardable(framework: str, model: nn.Module, fsdp2: str) -> None:
    """Refuse FSDP1 (``FullyShardedDataParallel``: flattened shards, not DTensors) and
    parameters that are not all on one device mesh (tensor parallelism, alone or beside
    FSDP2): Guard's gradient norm combines the shards of one mesh. ``fsdp2`` says how the
    framework shards with FSDP2."""
    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        raise ValueError(
            f"LossguardCallback: {framework} wrapped the model in FSDP1 "
            "(FullyShardedDataParallel), whose flattened shards the callback can neither measure "
            f"nor checkpoint; use FSDP2 ({fsdp2})"
        )
    params = list(model.parameters())
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    plain = sum(not isinstance(p, DTensor) for p in params)
    if len(meshes) > 1 or (meshes and plain):
        raise ValueError(
            f"LossguardCallback: the model's parameters are DTensors on {len(meshes)} device "
            f"mesh(es) and {plain} plain tensors; the gradient norm needs them all on one mesh "
            f"(FSDP2 / HSDP over the whole model: {fsdp2}) or none sharded, so tensor "
            "parallelism is not supported"
        )
