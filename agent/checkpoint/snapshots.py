"""In-memory snapshots: the state a checkpoint holds, copied to host memory every few steps.

A snapshot is the payload a checkpoint holds: ``Recovery.payload`` (every registered state
dict, the RNG states of all ranks), or under sharding ``Recovery.rank_payload`` with the model's
and optimizer's FQN-keyed state dicts: each rank keeps its own, and of a DTensor only its local
shard (``restore_into`` copies it back into the live one). Its meta is a ``CheckpointMeta``
named ``memory/step_XXXXXXXX`` with ``in_memory`` set in ``extra`` and no files; the ranks
agree on which exist (``Recovery.take_snapshot``).

Copies: CPU tensors are cloned. CUDA tensors go into pinned host buffers, reused from evicted
snapshots when shapes and dtypes match, on a side stream that first waits for the training
stream: the host never waits for a copy except before reusing a buffer still being filled (the
previous copy) and before a restore. The training stream waits on the device for the copy
before the next update changes the state (``before_update``).

Retention: the newest ``keep`` and the newest healthy one. A host memory budget bounds them:
a state whose ``keep + 1`` copies do not fit (``refusal``) turns snapshots off for the rest of
the process (``turn_off``, on every rank).
Snapshots die with the process; disk checkpoints are the crash path.
"""

from __future__ import annotations

import builtins
import copy
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lossguard.common.rundir.checkpoints import CheckpointMeta, checkpoint_name, meta_fields
from lossguard.common.rundir.targets import IN_MEMORY, MEMORY_PREFIX
from lossguard.common.sizes import format_bytes

_IMMUTABLE = (int, float, str, bool, bytes, type(None))


def snapshot_name(step: int) -> str:
    """``memory/step_00001200``: a snapshot's name, never a checkpoint folder's."""
    return MEMORY_PREFIX + checkpoint_name(step)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What a snapshot copies of ``tensor``: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors(obj: Any, *, local: bool = True) -> Iterator[torch.Tensor]:
    """The tensors in a payload, in a fixed walk order; of a DTensor, its local shard
    (``local``) or itself."""
    if isinstance(obj, torch.Tensor):
        yield _local(obj) if local else obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, local=local)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, local=local)


def _rebuild(obj: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """A copy of ``obj`` with its tensors replaced, in ``_tensors`` order, by ``tensors``.
    dicts, lists and tuples keep their types (and a state dict's ``_metadata``); other values
    are deep-copied unless immutable."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = _rebuild(value, tensors)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_rebuild(value, tensors) for value in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj if isinstance(obj, _IMMUTABLE) else copy.deepcopy(obj)


def payload_bytes(payload: dict[str, Any]) -> int:
    """Host bytes one snapshot of ``payload`` takes (its tensors; of DTensors, the shards)."""
    return sum(t.numel() * t.element_size() for t in _tensors(payload))


def restore_into(live: Any, saved: Any) -> Any:
    """``saved`` (a snapshot's state dicts) with each tensor's values copied into the tensor at
    the same place in ``live`` (fresh state dicts of the model and optimizer: the live
    tensors, DTensors into their local shards), which takes its place. The two must hold
    tensors of the same local shapes and dtypes in the same walk order, checked before
    anything is copied: else ValueError, and nothing changes. Other values are ``saved``'s."""
    targets = list(_tensors(live, local=False))
    values = list(_tensors(saved))
    if len(targets) != len(values) or any(
        _kind(_local(target)) != _kind(value)
        for target, value in zip(targets, values, strict=False)
    ):
        raise ValueError("the live state's tensors differ from the snapshot's")
    with torch.no_grad():
        for target, value in zip(targets, values, strict=True):
            _local(target).copy_(value)
    return _rebuild(saved, iter(targets))


def _kind(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(tensor.shape), tensor.dtype)


@dataclass
class _Snapshot:
    meta: CheckpointMeta
    payload: dict[str, Any]
    buffers: list[torch.Tensor]  # pinned host buffers of its CUDA tensors, for reuse
    copied: list[Any] = field(default_factory=list)  # CUDA events of copies in flight

    def wait(self) -> None:
        for event in self.copied:
            event.synchronize()
        self.copied = []


class SnapshotStore:
    """The snapshots of one rank, newest last. ``take`` runs in the training loop; ``list``,
    ``payload`` and ``discard_after`` from the training loop or the control side."""

    def __init__(self, *, keep: int, budget_bytes: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, not {keep}")
        self.keep = keep
        self.budget_bytes = budget_bytes
        self.enabled = True
        self.off_reason: str | None = None
        self._snapshots: list[_Snapshot] = []
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # evicted snapshots' buffers
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: list[tuple[torch.device, Any]] = []  # (device, event) to wait on
        self._streams: dict[torch.device, Any] = {}

    @property
    def held_bytes(self) -> int:
        """Host bytes the kept snapshots hold."""
        with self._lock:
            return sum(payload_bytes(s.payload) for s in self._snapshots)

    def take(
        self,
        step: int,
        payload: dict[str, Any],
        *,
        tokens: int,
        healthy: bool,
        train_loss: float | None,
        val_loss: float | None,
    ) -> CheckpointMeta:
        """Copy ``payload`` as the snapshot of ``step``, replacing one of the same step (the
        caller checked ``enabled`` and ``refusal``)."""
        fields = meta_fields(step, tokens, healthy, "snapshot", train_loss, val_loss, None)
        self._seq += 1
        meta = CheckpointMeta(
            **{**fields, "name": snapshot_name(step), "extra": {IN_MEMORY: True}},
            seq=self._seq,
            created_at=time.time(),
            files={},
            config_hash=None,
            versions={},
        )
        with self._lock:
            self._snapshots = [s for s in self._snapshots if s.meta.step != step]
            self._evict(extra=1)
            snapshot = self._copy(meta, payload)
            self._snapshots.append(snapshot)
        return meta

    def refusal(self, payload: dict[str, Any]) -> str | None:
        """Why ``keep + 1`` snapshots of ``payload`` do not fit the budget; None: they do."""
        size = payload_bytes(payload)
        needed = (self.keep + 1) * size
        if needed <= self.budget_bytes:
            return None
        return (
            f"{self.keep + 1} snapshots of {format_bytes(size)} need {format_bytes(needed)}, "
            f"over the budget of {format_bytes(self.budget_bytes)} (snapshot.budget, "
            "snapshot.keep)"
        )

    def turn_off(self, reason: str) -> None:
        """No more snapshots in this process, and none kept."""
        self.enabled = False
        self.off_reason = reason
        self.clear()

    def before_update(self) -> None:
        """The training stream waits (on the device) for copies in flight: call before the
        optimizer changes the state in place. No host sync."""
        for device, event in self._pending:
            torch.cuda.current_stream(device).wait_event(event)
        self._pending = []

    def list(self) -> builtins.list[CheckpointMeta]:
        """The snapshots' metas, oldest first."""
        with self._lock:
            return [s.meta for s in self._snapshots]

    def payload(self, name: str) -> dict[str, Any]:
        """A fresh CPU copy of the snapshot ``name``'s payload (training may change what it is
        given in place; the snapshot stays as taken). KeyError when there is none."""
        with self._lock:
            found = [s for s in self._snapshots if s.meta.name == name]
            if not found:
                raise KeyError(name)
            found[0].wait()
            source = found[0].payload
        clones = (t.clone() for t in list(_tensors(source)))
        return _rebuild(source, clones)

    def discard_after(self, step: int) -> builtins.list[str]:
        """Drop the snapshots of steps after ``step`` (a timeline a restore left); their names."""
        with self._lock:
            gone = [s for s in self._snapshots if s.meta.step > step]
            self._drop(gone)
        return [s.meta.name for s in gone]

    def clear(self) -> None:
        with self._lock:
            self._drop(list(self._snapshots))
            self._free = {}

    def _drop(self, gone: builtins.list[_Snapshot]) -> None:
        for snapshot in gone:
            self._snapshots.remove(snapshot)
            snapshot.wait()  # its buffers may be refilled next
            for buffer in snapshot.buffers:
                self._free.setdefault(_kind(buffer), []).append(buffer)

    def _evict(self, *, extra: int) -> None:
        """Keep room for ``extra`` new snapshots: the newest ``keep - extra`` stay, and the
        newest healthy one."""
        kept = self._snapshots[-(self.keep - extra) :] if self.keep > extra else []
        healthy = [s for s in self._snapshots if s.meta.healthy]
        if healthy and healthy[-1] not in kept:
            kept.insert(0, healthy[-1])
        self._drop([s for s in self._snapshots if s not in kept])

    def _copy(self, meta: CheckpointMeta, payload: dict[str, Any]) -> _Snapshot:
        sources = list(_tensors(payload))
        buffers: list[torch.Tensor] = []
        events: list[Any] = []
        copies: list[torch.Tensor] = []
        pairs: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for tensor in sources:
            tensor = tensor.detach()
            if tensor.device.type != "cuda":
                copies.append(tensor.to("cpu", memory_format=torch.contiguous_format, copy=True))
                continue
            buffer = self._buffer(tensor)
            buffers.append(buffer)
            copies.append(buffer)
            pairs.setdefault(tensor.device, []).append((tensor, buffer))
        for device, device_pairs in pairs.items():
            events.append(self._copy_on_side_stream(device, device_pairs))
        return _Snapshot(meta, _rebuild(payload, iter(copies)), buffers, events)

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer for ``tensor``: a free one of its shape and dtype, or a new one."""
        free = self._free.get(_kind(tensor))
        if free:
            return free.pop()
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def _copy_on_side_stream(
        self, device: torch.device, pairs: builtins.list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for source, buffer in pairs:
                buffer.copy_(source, non_blocking=True)
                source.record_stream(stream)  # temporaries (detector copies) outlive the copy
        event = torch.cuda.Event()
        event.record(stream)
        self._pending.append((device, event))
        return event
