"""Checkpoints of sharded models (format ``dcp``): every rank writes its own shards, in parallel.

A ``dcp`` checkpoint folder holds what ``torch.distributed.checkpoint`` writes for the model
and optimizer (``.metadata`` and one ``__K_0.distcp`` per rank; FQN-keyed state dicts from
``get_state_dict``, so a checkpoint loads at another world size) and ``rank_K.pt``: rank K's
other state (the registered non-sharded state dicts, its RNG states). The contract for readers
is the ``torch`` format's: the folder becomes visible only when complete on every rank. Rank 0
makes the hidden temporary folder, every rank writes into it, and once DCP's collective finish
(which follows every rank's write) is done every rank hashes the files it wrote (``owner``;
rank 0 also DCP's ``.metadata``), rank 0 gathers the digests, writes ``meta.json``
(``format: dcp``, ``extra.world_size``) and renames the folder into place
(``CheckpointStore.commit``). A rank killed mid-save leaves only the hidden folder, which the
next store removes.

Asynchronous saves: the state is staged into host buffers made at the first save and reused
(pinned on GPUs), then written by a thread of each rank, at the lowest CPU priority
(``background``), with ``dcp.save`` on its own gloo group, so the training loop's collectives
never interleave with the save's; rank 0's thread then publishes. At most one save is in
flight; training is blocked only for the staging.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lossguard.agent.checkpoint.background import start_writer
from lossguard.agent.checkpoint.snapshots import restore_into
from lossguard.agent.checkpoint.store import CheckpointStore, OnDone
from lossguard.agent.distributed import collective, control_group
from lossguard.agent.run_context import RunContext
from lossguard.common.rundir.checkpoints import DCP_FORMAT, CheckpointMeta, error_line
from lossguard.common.rundir.files import sha256_file, write_synced

log = logging.getLogger("lossguard.agent.checkpoint")

SHARDED_STATE = ("model", "optimizer")
"""The registered states a ``dcp`` checkpoint holds in DCP's files; the others are per rank."""
WORLD_SIZE = "world_size"
"""The ``meta.json`` ``extra`` field: how many ranks wrote the checkpoint."""


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


_RANK_WRITTEN = re.compile(r"rank_(\d+)\.pt|__(\d+)_\d+\.distcp")
"""The files rank K writes: ``rank_K.pt`` and DCP's data files (``__K_N.distcp``)."""


def owner(file_name: str, world_size: int) -> int:
    """The rank that hashes ``file_name`` of a ``dcp`` checkpoint: the rank that wrote it (it
    is in that rank's page cache, and on its node), rank 0 for any other file."""
    written = _RANK_WRITTEN.fullmatch(file_name)
    rank = int(written[1] or written[2]) if written else 0
    return rank if rank < world_size else 0


Digests = dict[str, str]
"""sha256 of checkpoint files, by file name."""


class DcpError(RuntimeError):
    """A DCP save or load failed: each failing rank's error, on one line."""


@contextlib.contextmanager
def dcp_errors() -> Iterator[None]:
    """Raise DCP's CheckpointException as a DcpError. DCP makes it a BaseException, which the
    ``except Exception`` that keeps a failed save or load from ending the training loop (and
    a writer thread from dying without a word) would let through."""
    try:
        yield
    except CheckpointException as exc:
        ranks = sorted(exc.failures.items())
        raise DcpError("; ".join(f"rank {r}: {error_line(e)}" for r, (e, _) in ranks)) from exc


class ShardedState:
    """A sharded model and its optimizer as DCP saves and loads them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizers = [optimizer] if optimizer is not None else []

    def state_dict(self) -> dict[str, Any]:
        """FQN-keyed state dicts of DTensors (references to the live shards, not copies)."""
        model, optim = get_state_dict(self.model, self.optimizers)
        return {"model": model, "optimizer": optim}

    def before_first_step(self) -> bool:
        """Whether the optimizer has no state yet: ``state_dict`` would make it by taking a
        step with zero gradients and learning rate (changing a stateful optimizer's step count)."""
        return any(not optimizer.state for optimizer in self.optimizers)

    def load_copy(self, saved: dict[str, Any]) -> None:
        """Load an in-memory snapshot's copy of ``state_dict`` (``saved`` holds this rank's
        local shards, at ``"model"`` and ``"optimizer"``): into the live shards, as a DCP load
        fills them, then applied as a loaded checkpoint is."""
        copied = {name: saved[name] for name in SHARDED_STATE}
        self.load_state_dict(restore_into(self.state_dict(), copied))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


class DcpCheckpoints:
    """Writes and reads ``dcp`` checkpoints on every rank; ``store`` (rank 0's, None elsewhere)
    publishes them. Collective: every rank calls ``save`` and ``load`` together (and builds
    this object at the same point: it makes a gloo group for the background writes)."""

    def __init__(
        self,
        ctx: RunContext,
        root: Path,
        sharded: ShardedState,
        *,
        store: CheckpointStore | None,
        timeout_s: float,
    ) -> None:
        self.root = root
        self.sharded = sharded
        self.store = store
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.group = control_group(timeout_s, "new_group: the dcp save group")
        # the state is staged into host buffers made at the first save and reused: on GPUs
        # pinned, by the writer's own stager (torch 2.11's DefaultStager cannot copy DTensors
        # there); on CPU by one DefaultStager kept from save to save (it caches its copies)
        cuda = ctx.device.type == "cuda"
        self.writer = FileSystemWriter(root, cache_staged_state_dict=True) if cuda else None
        self.stager: BlockingAsyncStager | DefaultStager = self.writer or DefaultStager(
            StagingOptions(False, False, False, False)
        )
        self._delay_s = 0.0
        self._background: threading.Thread | None = None

    def wait(self) -> None:
        """Block until this rank's part of the save in flight (rank 0: its publication) is done."""
        if self._background is not None:
            self._background.join()
            self._background = None

    def save(
        self,
        rank_payload: dict[str, Any],
        fields: dict[str, Any],
        *,
        wait: bool,
        on_done: OnDone | None,
    ) -> None:
        """Write this rank's shards and ``rank_payload``; rank 0 publishes the checkpoint of
        ``fields`` (``meta_fields``) once every rank is done, then calls ``on_done`` with the
        meta or the error. ``wait``: before returning; else in the background."""
        self.wait()
        tmp = self._temp_folder(fields["name"])
        write_synced(tmp / rank_file(self.rank), lambda fh: torch.save(rank_payload, fh))
        fields = {**fields, "extra": {**fields["extra"], WORLD_SIZE: self.world_size}}
        self._delay_s = self.store.write_delay_s if self.store is not None else 0.0
        if wait:
            self._write_now(tmp, fields, on_done, self.sharded.state_dict())
            return
        # staged now (the next step changes the weights), written in the background
        staged = self.stager.stage(self.sharded.state_dict())
        assert isinstance(staged, dict)  # both stagers copy before returning
        self._background = start_writer(
            lambda: self._write_now(tmp, fields, on_done, staged),
            name=f"lossguard-dcp-{fields['step']}",
        )

    def _temp_folder(self, name: str) -> Path:
        """Rank 0 makes the hidden folder; every rank learns its name."""
        box = [str(self.store.temp_folder(name)) if self.store is not None else None]
        with collective("broadcast_object_list: dcp checkpoint folder"):
            dist.broadcast_object_list(box, src=0, group=self.group)
        return Path(str(box[0]))

    def _write_now(
        self,
        tmp: Path,
        fields: dict[str, Any],
        on_done: OnDone | None,
        state: dict[str, Any],
    ) -> None:
        """Write this rank's shards (``state``: live or staged) with the collective
        ``dcp.save``; rank 0 then publishes (DCP's finish on rank 0 follows every rank's write)."""
        written: Digests | Exception
        try:
            with dcp_errors(), collective("dcp.save: checkpoint shards", io=True):
                dcp.save(
                    state, checkpoint_id=tmp, storage_writer=self.writer, process_group=self.group
                )
            written = self._hash_own_files(tmp)
        except Exception as exc:  # rank 0 reports it; a failed save must not stop training
            written = exc
            if self.store is None:
                log.warning("rank %d: checkpoint write failed: %r", self.rank, exc, exc_info=exc)
        try:
            digests = self._gather(written)
        except Exception as exc:  # not the group (a failed collective ends the rank)
            digests = exc
        if self.store is not None:
            self._finish(digests, tmp, fields, on_done)

    def _hash_own_files(self, tmp: Path) -> Digests:
        """sha256 of the complete checkpoint's files this rank hashes (``owner``)."""
        return {
            path.name: sha256_file(path)
            for path in sorted(tmp.iterdir())
            if path.is_file() and owner(path.name, self.world_size) == self.rank
        }

    def _gather(self, written: Digests | Exception) -> Digests | Exception:
        """Collective on the save's group: rank 0 gets every rank's digests merged, or the
        first rank's error (other ranks get their own result back)."""
        parts: list[Digests | str | None] = [None] * self.world_size
        mine = written if isinstance(written, dict) else self._failure(written)
        with collective("gather_object: dcp checkpoint digests"):
            dist.gather_object(mine, parts if self.rank == 0 else None, dst=0, group=self.group)
        if self.rank != 0:
            return written
        merged: Digests = {}
        for part in parts:
            if not isinstance(part, dict):
                return RuntimeError(part)
            merged.update(part)
        return merged

    def _failure(self, error: Exception) -> str:
        """``error`` on one line, naming the rank it happened on (a DcpError names them)."""
        return (
            str(error) if isinstance(error, DcpError) else f"rank {self.rank}: {error_line(error)}"
        )

    def _finish(
        self,
        digests: Digests | Exception,
        tmp: Path,
        fields: dict[str, Any],
        on_done: OnDone | None,
    ) -> None:
        """Rank 0: publish the written checkpoint, or drop it; report either to ``on_done``."""
        assert self.store is not None
        result: CheckpointMeta | BaseException
        if isinstance(digests, Exception):
            shutil.rmtree(tmp, ignore_errors=True)
            result = RuntimeError(f"checkpoint {fields['name']}: write failed ({digests})")
        else:
            time.sleep(self._delay_s)  # the slow_save fault drill (as at save time); 0 otherwise
            try:
                result = self.store.commit(tmp, fields, DCP_FORMAT, digests=digests)
            except Exception as exc:
                result = exc
        if on_done is not None:
            on_done(result)
        elif isinstance(result, BaseException):
            log.error("%s", result)

    def rank_payload(self, meta: CheckpointMeta) -> dict[str, Any]:
        """This rank's part of checkpoint ``meta`` (rank 0's when fewer ranks wrote it)."""
        saved_world = int(meta.extra.get(WORLD_SIZE, 1))
        source = self.rank if self.rank < saved_world else 0
        path = self.root / meta.name / rank_file(source)
        payload: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        return payload

    def load_sharded(self, meta: CheckpointMeta) -> None:
        """Collective: read the model and optimizer shards of checkpoint ``meta`` (resharded
        to this world size) into the live model and optimizer."""
        state = self.sharded.state_dict()
        with dcp_errors(), collective("dcp.load: checkpoint shards", io=True):
            dcp.load(state, checkpoint_id=self.root / meta.name, process_group=self.group)
        self.sharded.load_state_dict(state)

    def close(self) -> None:
        """Wait for the save in flight and release the staging buffers."""
        self.wait()
        self.stager.close()
