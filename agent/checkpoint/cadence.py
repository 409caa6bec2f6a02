"""When the Guard saves and snapshots on its own: the periodic checkpoint's step or time
cadence, the snapshot cadence, and the in-memory snapshot store that ``snapshot`` configures."""

from __future__ import annotations

import os
import time
from typing import Any

from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.config import CheckpointConfig, GuardConfig, SnapshotConfig
from lossguard.agent.distributed import all_reduce_max
from lossguard.agent.restored import Restored
from lossguard.common.sizes import budget_bytes


def periodic_save_due(
    cfg: CheckpointConfig, step: int, logged: bool, last_saved_at: float, group: Any
) -> bool:
    """Whether the step just done gets a periodic checkpoint: every ``cfg.every`` steps, or
    (``every`` unset) at the first log interval ``cfg.every_seconds`` after the last save.
    Every rank agrees: the time is compared at log intervals only, with one small collective."""
    if cfg.every is not None:
        return step % cfg.every == 0
    if cfg.every_seconds is None or not logged:
        return False
    late = time.monotonic() - last_saved_at >= cfg.every_seconds
    return bool(all_reduce_max([int(late)], group, "all_reduce: time cadence save due")[0])


class Due:
    """What the step boundary just reached takes at the next poll: the periodic checkpoint
    (``save``) and the snapshot (``snapshot``; one not taken yet stays due)."""

    def __init__(self, config: GuardConfig, group: Any) -> None:
        self.config = config
        self.group = group
        self.save = False
        self.snapshot = False

    def step_done(self, step: int, logged: bool, last_saved_at: float) -> None:
        """After optimizer step ``step`` (``logged``: its log interval was written)."""
        self.save = periodic_save_due(
            self.config.checkpoint, step, logged, last_saved_at, self.group
        )
        every = self.config.snapshot.every
        self.snapshot = self.snapshot or (every is not None and step % every == 0)

    def restored(self, restored: Restored) -> None:
        """After a restore: what this boundary was due to take belongs to the timeline left."""
        self.save = self.snapshot = False


def snapshot_store(cfg: SnapshotConfig) -> SnapshotStore | None:
    """The snapshots ``cfg`` asks for (None: off), with this rank's share of the host budget
    (the ranks on this host, ``$LOCAL_WORLD_SIZE``, share it)."""
    if cfg.every is None:
        return None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return SnapshotStore(keep=cfg.keep, budget_bytes=budget_bytes(cfg.budget, local_ranks))
