"""The ``torch`` checkpoint format, for plain and DDP models: the whole payload (every registered
state dict, every rank's RNG states) in one ``state.pt``, which rank 0 writes and reads through
the ``CheckpointStore``; a restore broadcasts it to every rank."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lossguard.agent.checkpoint.formats import (
    OnSaved,
    Stateful,
    chosen_by_main,
    from_memory,
    state_dicts,
    upgraded,
    versioned,
)
from lossguard.agent.checkpoint.snapshot import snapshot
from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.distributed import all_gather_objects
from lossguard.agent.rng import capture_rng
from lossguard.agent.run_context import RunContext
from lossguard.common.control.protocol import Target
from lossguard.common.rundir.checkpoints import CheckpointMeta


class TorchFormat:
    """``torch`` checkpoints of ``store`` (rank 0's, None elsewhere) and the in-memory
    ``snapshots`` of the same payloads."""

    apart: frozenset[str] = frozenset()

    def __init__(
        self, ctx: RunContext, *, store: CheckpointStore | None, snapshots: SnapshotStore | None
    ) -> None:
        self.ctx = ctx
        self.store = store
        self.snapshots = snapshots

    def payload(self, state: Mapping[str, Stateful], healthy: bool) -> tuple[dict[str, Any], bool]:
        """Collective: the RNG states and health of all ranks are gathered."""
        gathered = all_gather_objects(
            (capture_rng(), healthy), self.ctx.group, "all_gather_object: RNG states and health"
        )
        rng = [rank_rng for rank_rng, _ in gathered]
        payload = versioned(self.ctx.world_size, rng, state_dicts(state, self.apart))
        return payload, all(rank_healthy for _, rank_healthy in gathered)

    def snapshot_payload(
        self, state: Mapping[str, Stateful], healthy: bool
    ) -> tuple[dict[str, Any], bool]:
        return self.payload(state, healthy)

    def wait(self) -> None:
        if self.store is not None:
            self.store.wait()

    def write(
        self,
        payload: dict[str, Any],
        step: int,
        facts: dict[str, Any],
        *,
        wait: bool,
        on_done: OnSaved | None,
    ) -> None:
        """Rank 0 writes (a copy off the device, in the background unless ``wait``); the other
        ranks have nothing to write."""
        if self.store is None:
            return
        if not wait:
            self.store.save_async(step, snapshot(payload), on_done=on_done, **facts)
            return
        try:
            meta = self.store.save(step, payload, **facts)
        except Exception as exc:  # a failed save must not stop training
            if on_done is not None:
                on_done(exc)
            return
        if on_done is not None:
            on_done(meta)

    def load(
        self, target: Target, before_step: int | None
    ) -> tuple[CheckpointMeta, dict[str, Any]]:
        """Rank 0 loads the checkpoint and every rank gets its payload; or a snapshot, each
        rank's own from memory."""
        loaded = chosen_by_main(self._chooser(target, before_step), self.ctx.group)
        meta, payload = loaded["meta"], loaded["payload"]
        if payload is None:  # a snapshot: each rank takes its own from memory
            payload = from_memory(self.snapshots, meta.name, self.ctx.group)
        return meta, upgraded(payload, meta.name)

    def _chooser(
        self, target: Target, before_step: int | None
    ) -> Callable[[], dict[str, Any]] | None:
        """Rank 0's choice, once the save in flight is done (None on the other ranks)."""
        store = self.store
        if store is None:
            return None
        store.wait()
        memory = self.snapshots.list() if self.snapshots is not None else []

        def choose() -> dict[str, Any]:
            meta, payload = store.load_or_snapshot(target, before_step, memory)
            return {"meta": meta, "payload": payload}

        return choose

    def load_apart(self, meta: CheckpointMeta, payload: dict[str, Any]) -> None:
        """Nothing is held apart: the payload is all."""

    def close(self, *, failed: bool) -> None:
        self.wait()
