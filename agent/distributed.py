"""torchrun integration: process group, device placement and lossguard's collectives.

Every collective the agent makes goes through :func:`collective`, named for what it is for
(``docs/distributed.md`` lists them): a rank that is stuck in one can say which, and a
failed one (a peer gone, ``distributed.timeout`` passed) ends the rank with the retryable exit
code instead of leaving it half-way through a step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from lossguard.common.config import ConfigError
from lossguard.common.exitcodes import EXIT_RETRYABLE

T = TypeVar("T")
log = logging.getLogger("lossguard.agent")


@dataclass(frozen=True)
class InFlight:
    """The collective a thread is in: its name, since when (monotonic), and whether it is a
    checkpoint's reads or writes (``io``: long by nature, never taken for stuck on a stop)."""

    what: str
    since: float
    io: bool = False


_in_flight: dict[int, InFlight] = {}
"""The collective each thread is in now, by thread id."""


@contextlib.contextmanager
def collective(what: str, *, io: bool = False) -> Iterator[None]:
    """Around one collective, named ``what`` (e.g. ``all_reduce: commands and signals``): the
    calling thread is marked as inside it, and if it fails (a peer gone, the group's timeout),
    the rank ends at once with one line naming it and the retryable exit code: the group is
    unusable and the other ranks are gone or stuck, so nothing collective can follow. ``io``:
    a checkpoint's collective write or read (``InFlight``)."""
    ident = threading.get_ident()
    entered = InFlight(what, time.monotonic(), io)
    _in_flight[ident] = entered
    try:
        yield
    except RuntimeError as exc:  # torch.distributed.DistError and the backends' errors
        seconds = time.monotonic() - entered.since
        end_rank(f"{what} failed after {seconds:.0f} s ({_one_line(exc)})")
    finally:
        _in_flight.pop(ident, None)


def in_collective(thread: threading.Thread) -> InFlight | None:
    """The collective ``thread`` is in, or None."""
    return _in_flight.get(thread.ident) if thread.ident is not None else None


def end_rank(why: str) -> NoReturn:
    """End this rank now with the retryable exit code (75), after one line saying ``why``:
    a rank whose collectives cannot complete must not hold its GPU; the supervisor (or the
    scheduler) restarts every node from the newest checkpoint. Nothing else runs: no save,
    no close (the group cannot be trusted), no atexit handler."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    log.critical("rank %d: %s; exiting %d (retryable)", rank, why, EXIT_RETRYABLE)
    for name in ("", "lossguard", "lossguard.agent"):  # where handlers are attached
        for handler in logging.getLogger(name).handlers:
            with contextlib.suppress(Exception):
                handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_RETRYABLE)


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


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


def setup_distributed(
    device_preference: str, *, timeout_s: float, always: bool = False
) -> DistInfo:
    """Join the torchrun process group (gloo on CPU, nccl on GPU) when WORLD_SIZE > 1, or
    ``always`` (sharding needs one even alone: outside torchrun, a group of one on 127.0.0.1).
    ``timeout_s`` (``distributed.timeout``): how long a collective waits for its peers."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    if (world_size > 1 or always) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            address = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(
                backend=backend, init_method=address, rank=0, world_size=1, timeout=timeout
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
            barrier("barrier: the run ends")
        dist.destroy_process_group()


def barrier(what: str) -> None:
    if dist.is_initialized():
        with collective(what):
            dist.barrier()


def broadcast_from_main(value: T, what: str) -> T:
    """Rank 0's value on every rank."""
    if not dist.is_initialized():
        return value
    box: list[T | None] = [value]
    with collective(what):
        dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def all_reduce_max_tensor(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Element-wise maximum over ranks, in place (on the training device)."""
    if dist.is_initialized():
        with collective(what):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 outside torchrun)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Sum a tensor over ranks in place (gloo has no AVG) and return it."""
    if dist.is_initialized():
        with collective(what):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def control_group(
    timeout_s: float, what: str = "new_group: the control group"
) -> dist.ProcessGroup | None:
    """A CPU (gloo) group for control traffic, so commands never sync a GPU stream; its
    collectives wait ``timeout_s`` for their peers (``distributed.timeout``). Collective: every
    rank calls it at the same point. None outside torchrun."""
    if not dist.is_initialized():
        return None
    with collective(what):
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def all_gather_objects(value: T, group: dist.ProcessGroup | None, what: str) -> list[T]:
    """Every rank's value, in rank order, on every rank."""
    if group is None:
        return [value]
    gathered: list[T | None] = [None] * dist.get_world_size()
    with collective(what):
        dist.all_gather_object(gathered, value, group=group)
    return gathered  # type: ignore[return-value]


def broadcast_objects(values: list[T], group: dist.ProcessGroup | None, what: str) -> list[T]:
    """Rank 0's list on every rank (other ranks pass a placeholder of the same length)."""
    if group is None:
        return values
    box = list(values)
    with collective(what):
        dist.broadcast_object_list(box, src=0, group=group)
    return box


def all_reduce_max(values: list[int], group: dist.ProcessGroup | None, what: str) -> list[int]:
    """Element-wise maximum over ranks of a few integers."""
    if group is None:
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    with collective(what):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in tensor.tolist()]
