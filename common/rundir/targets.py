"""Which checkpoints a target (``latest``, ``best``, ``last_good`` or a step) means, the
superseded flag that keeps named targets off an abandoned timeline, and the listing that the
``checkpoints`` command answers. Torch-free."""

from __future__ import annotations

import math
from typing import Any

from lossguard.common.rundir.checkpoints import CheckpointError, CheckpointMeta

NAMED_TARGETS = ("latest", "best", "last_good")
SUPERSEDED = "superseded"  # meta.extra flag, see CheckpointStore.supersede_after


def is_superseded(meta: CheckpointMeta) -> bool:
    """Written on a timeline that a rollback (or a resume from an older checkpoint) left."""
    return bool(meta.extra.get(SUPERSEDED))


def ordered(metas: list[CheckpointMeta], target: str | int) -> list[CheckpointMeta]:
    """The checkpoints that ``target`` may mean, most preferred first. Named targets and
    fallbacks skip superseded checkpoints; an explicit step still reaches one."""
    newest_first = sorted(metas, key=lambda m: m.seq, reverse=True)
    current = [m for m in newest_first if not is_superseded(m)]
    if target == "latest":
        return current
    if target == "best":
        scored = [
            (m.val_loss, m) for m in current if m.val_loss is not None and math.isfinite(m.val_loss)
        ]
        return [m for _, m in sorted(scored, key=lambda pair: pair[0])]  # stable: newer first
    if target == "last_good":
        return [m for m in current if m.healthy]
    if isinstance(target, int) and not isinstance(target, bool):
        exact = [m for m in newest_first if m.step == target]
        if not exact:
            return []
        earlier = [m for m in current if m.seq < exact[-1].seq and m.step < target]
        return exact + earlier
    raise CheckpointError(
        f"unknown checkpoint target {target!r}: use {', '.join(NAMED_TARGETS)} or a step number"
    )


def listing(metas: list[CheckpointMeta]) -> dict[str, Any]:
    """The ``checkpoints`` command's result: every checkpoint's meta, oldest first, and the
    names that ``latest``, ``best`` and ``last_good`` resolve to (None where none does)."""
    named = {target: next(iter(ordered(metas, target)), None) for target in NAMED_TARGETS}
    return {
        "checkpoints": [meta.to_dict() for meta in metas],
        **{target: meta.name if meta else None for target, meta in named.items()},
    }
