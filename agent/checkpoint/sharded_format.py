"""The ``dcp`` checkpoint format, for sharded FSDP2 / HSDP models: the model and optimizer go
through ``torch.distributed.checkpoint`` (``dcp_format.DcpCheckpoints``: every rank writes and
reads its shards, resharded at another world size); every other registered state and this
rank's RNG states go into the rank's own ``rank_K.pt``. Rank 0 chooses and verifies the
checkpoint to restore; each rank reads its part."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from lossguard.agent.checkpoint.dcp_format import SHARDED_STATE, WORLD_SIZE, DcpCheckpoints
from lossguard.agent.checkpoint.formats import (
    OnSaved,
    RestoreError,
    Stateful,
    chosen_by_main,
    from_memory,
    state_dicts,
    upgraded,
    versioned,
)
from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.distributed import all_gather_objects
from lossguard.agent.rng import capture_rng
from lossguard.agent.run_context import RunContext
from lossguard.common.control.protocol import Target
from lossguard.common.rundir.checkpoints import DCP_FORMAT, CheckpointMeta, meta_fields
from lossguard.common.rundir.events import RESHARDED
from lossguard.common.rundir.targets import is_in_memory

log = logging.getLogger("lossguard.agent")


class DcpFormat:
    """``dcp`` checkpoints written by ``files`` and published to ``store`` (rank 0's, None
    elsewhere); ``snapshots``: this rank's in-memory ones, of its own shards."""

    apart: frozenset[str] = frozenset(SHARDED_STATE)

    def __init__(
        self,
        ctx: RunContext,
        files: DcpCheckpoints,
        *,
        store: CheckpointStore | None,
        snapshots: SnapshotStore | None,
    ) -> None:
        self.ctx = ctx
        self.files = files
        self.store = store
        self.snapshots = snapshots

    def payload(self, state: Mapping[str, Stateful], healthy: bool) -> tuple[dict[str, Any], bool]:
        """This rank's part of a checkpoint (all but the sharded model and optimizer, and this
        rank's RNG states), and whether every rank is healthy now (collective)."""
        gathered = all_gather_objects(healthy, self.ctx.group, "all_gather_object: health")
        payload = versioned(self.ctx.world_size, [capture_rng()], state_dicts(state, self.apart))
        return payload, all(gathered)

    def snapshot_payload(
        self, state: Mapping[str, Stateful], healthy: bool
    ) -> tuple[dict[str, Any], bool] | None:
        """``payload`` with this rank's shards of the model and optimizer; None before the
        optimizer's first step (``get_state_dict`` would make its state by stepping it)."""
        if self.files.sharded.before_first_step():
            return None
        payload, all_healthy = self.payload(state, healthy)
        payload["state"].update(self.files.sharded.state_dict())
        return payload, all_healthy

    def wait(self) -> None:
        if self.store is not None:
            self.store.wait()
        self.files.wait()

    def write(
        self,
        payload: dict[str, Any],
        step: int,
        facts: dict[str, Any],
        *,
        wait: bool,
        on_done: OnSaved | None,
    ) -> None:
        """Every rank writes its shards and ``payload``; rank 0 the meta."""
        fields = meta_fields(step, extra=None, **facts)
        self.files.save(payload, fields, wait=wait, on_done=on_done)

    def load(
        self, target: Target, before_step: int | None
    ) -> tuple[CheckpointMeta, dict[str, Any]]:
        """A ``dcp`` checkpoint, verified by rank 0, and this rank's payload (the sharded
        state is read by ``load_apart``); or an in-memory snapshot, each rank's own shards."""
        self.files.wait()
        meta: CheckpointMeta = chosen_by_main(self._chooser(target, before_step), self.ctx.group)
        if is_in_memory(meta):
            return meta, upgraded(from_memory(self.snapshots, meta.name, self.ctx.group), meta.name)
        if meta.format != DCP_FORMAT:
            raise RestoreError(
                f"{meta.name} is a {meta.format} checkpoint of a model that was not sharded; "
                f"this sharded run loads {DCP_FORMAT} checkpoints"
            )
        payload = self.files.rank_payload(meta)
        saved_world = int(meta.extra.get(WORLD_SIZE, 1))
        if saved_world != self.ctx.world_size and self.ctx.main:
            message = (
                f"{meta.name} was written by {saved_world} ranks and loads on "
                f"{self.ctx.world_size}: model and optimizer state are resharded exactly, but "
                "the per-rank RNG states (dropout), detector windows and data streams are not (a "
                "rank without its own takes rank 0's): training goes on, it does not replay bit "
                "for bit"
            )
            log.warning("%s", message)
            self.ctx.event(RESHARDED, checkpoint=meta.name, saved_world_size=saved_world)
        return meta, upgraded(payload, meta.name)

    def _chooser(
        self, target: Target, before_step: int | None
    ) -> Callable[[], CheckpointMeta] | None:
        """Rank 0's choice: the first state that is in memory or whose files verify (None on
        the other ranks)."""
        store = self.store
        if store is None:
            return None
        memory = self.snapshots.list() if self.snapshots is not None else []
        return lambda: store.load_verified(target, before_step, memory)

    def load_apart(self, meta: CheckpointMeta, payload: dict[str, Any]) -> None:
        """The model's and optimizer's shards: from the snapshot's copy, or read by DCP."""
        if is_in_memory(meta):
            self.files.sharded.load_copy(payload["state"])
        else:
            self.files.load_sharded(meta)

    def close(self, *, failed: bool) -> None:
        if not failed:  # its writes are collective
            self.files.close()
        if self.store is not None:
            self.store.wait()
