"""torchrun integration: process group, device placement and small collectives."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from lossguard.common.config import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(preference: str, local_rank: int) -> torch.device:
    """auto = the local rank's GPU when CUDA is available, else the CPU."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device: cuda requested but no CUDA device is available")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def setup_distributed(device_preference: str, *, always: bool = False) -> DistInfo:
    """Join the torchrun process group (gloo on CPU, nccl on GPU) when WORLD_SIZE > 1, or
    ``always`` (sharding needs one even alone: outside torchrun, a group of one on 127.0.0.1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    if (world_size > 1 or always) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(
                backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    return DistInfo(rank, world_size, local_rank, device)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def teardown_distributed(*, together: bool = True) -> None:
    """Leave the process group: together (a barrier first: a rank that destroys it early
    aborts under gloo), or alone after a failure, when the others may never arrive."""
    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_from_main(value: T) -> T:
    """Rank 0's value on every rank."""
    if not dist.is_initialized():
        return value
    box: list[T | None] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def all_reduce_max_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over ranks, in place (on the training device)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 outside torchrun)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (gloo has no AVG) and return it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def control_group() -> dist.ProcessGroup | None:
    """A CPU (gloo) group for control traffic, so commands never sync a GPU stream.
    Collective: every rank calls it at the same point. None outside torchrun."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo")


def all_gather_objects(value: T, group: dist.ProcessGroup | None) -> list[T]:
    """Every rank's value, in rank order, on every rank."""
    if group is None:
        return [value]
    gathered: list[T | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=group)
    return gathered  # type: ignore[return-value]


def broadcast_objects(values: list[T], group: dist.ProcessGroup | None) -> list[T]:
    """Rank 0's list on every rank (other ranks pass a placeholder of the same length)."""
    if group is None:
        return values
    box = list(values)
    dist.broadcast_object_list(box, src=0, group=group)
    return box


def all_reduce_max(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Element-wise maximum over ranks of a few integers."""
    if group is None:
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in tensor.tolist()]
