"""Which checkpoints a target (``latest``, ``best``, ``last_good`` or a step) means, the
superseded flag that keeps named targets off an abandoned timeline, and the listing that the
``checkpoints`` command answers. Torch-free."""

from __future__ import annotations

import math
from typing import Any

from lossguard.common.rundir.checkpoints import CheckpointError, CheckpointMeta

NAMED_TARGETS = ("latest", "best", "last_good")
SUPERSEDED = "superseded"  # meta.extra flag, see CheckpointStore.supersede_after
MEMORY_PREFIX = "memory/"  # of an in-memory snapshot's name: memory/step_00001200
IN_MEMORY = "in_memory"  # meta.extra flag of an in-memory snapshot (checkpoint.snapshots)


def is_in_memory(meta: CheckpointMeta) -> bool:
    return bool(meta.extra.get(IN_MEMORY))


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


def ordered_states(
    disk: list[CheckpointMeta], memory: list[CheckpointMeta], target: str | int
) -> list[CheckpointMeta]:
    """``ordered`` over checkpoints on disk and snapshots in memory together, most preferred
    first: the two orders merged, each kept as it is. A snapshot goes before a checkpoint it
    is at least as good as for ``target`` (a later step; for ``best`` a lower val loss; for a
    step, the exact one): the cheaper restore."""
    if target == "best":

        def key(m: CheckpointMeta) -> tuple[Any, ...]:
            return (m.val_loss, -m.step)
    else:

        def key(m: CheckpointMeta) -> tuple[Any, ...]:
            return (m.step != target, -m.step)

    first, second = ordered(memory, target), ordered(disk, target)
    merged: list[CheckpointMeta] = []
    while first and second:
        merged.append(first.pop(0) if key(first[0]) <= key(second[0]) else second.pop(0))
    return merged + first + second


def named_states(
    disk: list[CheckpointMeta], memory: list[CheckpointMeta]
) -> dict[str, CheckpointMeta | None]:
    """What ``latest``, ``best`` and ``last_good`` resolve to (None where nothing does)."""
    return {t: next(iter(ordered_states(disk, memory, t)), None) for t in NAMED_TARGETS}


def listing(
    metas: list[CheckpointMeta], snapshots: list[CheckpointMeta] | None = None
) -> dict[str, Any]:
    """The ``checkpoints`` command's result: every checkpoint's and snapshot's meta, oldest
    step first, each with ``in_memory``, and the names that ``latest``, ``best`` and
    ``last_good`` resolve to (None where none does)."""
    memory = snapshots or []
    named = named_states(metas, memory)
    states = sorted([*metas, *memory], key=lambda m: (m.step, is_in_memory(m)))
    return {
        "checkpoints": [{**meta.to_dict(), IN_MEMORY: is_in_memory(meta)} for meta in states],
        **{target: meta.name if meta else None for target, meta in named.items()},
    }
