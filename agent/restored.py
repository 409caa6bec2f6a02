"""The one notice of a restore: whoever restores a checkpoint (a resume, a rollback) publishes a
``Restored`` once it is complete, and every part that keeps per-timeline bookkeeping listens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from lossguard.common.rundir.checkpoints import CheckpointMeta

RestoreKind = Literal["restore", "rollback"]


@dataclass(frozen=True)
class Restored:
    """A restore of ``meta`` just completed, its batches skipped and (a ``rollback``) its
    learning-rate scale set: training goes on from ``step`` and ``tokens``, at data ``position``
    (None: the data has none)."""

    meta: CheckpointMeta
    step: int
    tokens: int
    position: int | None
    kind: RestoreKind


RestoreListener = Callable[[Restored], None]


class Restores:
    """Tells each listener of every restore, in the order they subscribed."""

    def __init__(self) -> None:
        self._listeners: list[RestoreListener] = []

    def subscribe(self, listener: RestoreListener) -> None:
        self._listeners.append(listener)

    def publish(self, restored: Restored) -> None:
        for listener in self._listeners:
            listener(restored)
