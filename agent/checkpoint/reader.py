"""``CheckpointReader``: the checkpoints under ``run_dir/checkpoints`` as a restore finds them:
listed, a target resolved to its candidates, each verified against its ``meta.json`` hashes,
the first usable one loaded. ``CheckpointStore`` is the reader that also writes them.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from lossguard.common.rundir.checkpoints import (
    META_FILE,
    REQUIRED_FILE,
    STATE_FILE,
    TORCH_FORMAT,
    CheckpointError,
    CheckpointMeta,
    error_line,
    list_checkpoints,
)
from lossguard.common.rundir.files import sha256_file
from lossguard.common.rundir.targets import NAMED_TARGETS, is_in_memory, ordered, ordered_states

# the store's logger: log records and logging settings keep it
log = logging.getLogger("lossguard.agent.checkpoint")

T = TypeVar("T")


class _Unusable(Exception):
    """The problem of one checkpoint, without its name."""


class CheckpointReader:
    """The checkpoints of one run under ``root`` (``run_dir/checkpoints``), read from any thread."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def list(self) -> builtins.list[CheckpointMeta]:
        """Visible checkpoints in creation order; unreadable ones are skipped with a warning."""
        return list_checkpoints(self.root)

    def resolve(
        self,
        target: str | int,
        before_step: int | None = None,
        snapshots: Sequence[CheckpointMeta] = (),
    ) -> builtins.list[CheckpointMeta]:
        """Candidates for ``target`` (latest, best, last_good or a step), most preferred first,
        among the checkpoints and ``snapshots`` (in memory). ``before_step``: prefer states of
        earlier steps (a rollback away from trouble that began after them); when there is
        none, the others still count."""
        candidates = ordered_states(self.list(), list(snapshots), target)
        if not candidates:
            nor = " nor in memory" if snapshots else ""
            raise CheckpointError(f"no checkpoint matches target {target!r} in {self.root}{nor}")
        if before_step is not None:
            earlier = [m for m in candidates if m.step < before_step]
            if not earlier:
                log.warning(
                    "no %s checkpoint before step %d; using %s",
                    target,
                    before_step,
                    candidates[0].name,
                )
            return earlier or candidates
        return candidates

    def named(self) -> dict[str, CheckpointMeta | None]:
        """The latest, best and last good checkpoints (None where there is none)."""
        metas = self.list()
        return {target: next(iter(ordered(metas, target)), None) for target in NAMED_TARGETS}

    def load(
        self, target: str | int, before_step: int | None = None
    ) -> tuple[CheckpointMeta, dict[str, Any]]:
        """The first usable candidate for ``target`` (``resolve``) and its state, loaded on the
        CPU. Each unusable candidate is logged as a warning naming it, the problem and the next
        one."""
        meta, state = self.load_or_snapshot(target, before_step)
        assert state is not None  # no snapshots were offered
        return meta, state

    def load_verified(
        self,
        target: str | int,
        before_step: int | None = None,
        snapshots: Sequence[CheckpointMeta] = (),
    ) -> CheckpointMeta:
        """``load_or_snapshot`` without reading the state: the first candidate that is in
        memory or whose files verify (a ``dcp`` checkpoint, which every rank reads its part of)."""
        meta, _ = self._first_usable(target, before_step, self._verify, snapshots)
        return meta

    def load_or_snapshot(
        self,
        target: str | int,
        before_step: int | None = None,
        snapshots: Sequence[CheckpointMeta] = (),
    ) -> tuple[CheckpointMeta, dict[str, Any] | None]:
        """``load`` among the checkpoints and ``snapshots`` (in memory): a snapshot chosen comes
        back with None, its state being the caller's to take from memory."""
        return self._first_usable(target, before_step, self._read_state, snapshots)

    def _first_usable(
        self,
        target: str | int,
        before_step: int | None,
        read: Callable[[CheckpointMeta], T],
        snapshots: Sequence[CheckpointMeta] = (),
    ) -> tuple[CheckpointMeta, T | None]:
        candidates = self.resolve(target, before_step, snapshots)
        for index, meta in enumerate(candidates):
            if is_in_memory(meta):
                return meta, None
            try:
                return meta, read(meta)
            except _Unusable as exc:
                following = candidates[index + 1 : index + 2]
                instead = f"trying {following[0].name}" if following else "no other candidate"
                log.warning("checkpoint %s is unusable (%s); %s", meta.name, exc, instead)
        tried = ", ".join(m.name for m in candidates)
        raise CheckpointError(
            f"no usable checkpoint for target {target!r} in {self.root} (tried {tried})"
        )

    def verify(self, meta: CheckpointMeta) -> None:
        """Raise CheckpointError unless every file in ``meta.files`` exists and hashes right."""
        try:
            self._verify(meta)
        except _Unusable as exc:
            raise CheckpointError(f"checkpoint {meta.name}: {exc}") from None

    def _verify(self, meta: CheckpointMeta) -> None:
        required = REQUIRED_FILE[meta.format]
        if required not in meta.files:
            raise _Unusable(f"{required} is not listed in {META_FILE}")
        for file_name, expected in meta.files.items():
            try:
                actual = sha256_file(self.root / meta.name / file_name)
            except FileNotFoundError:
                raise _Unusable(f"{file_name} is missing") from None
            except OSError as exc:
                raise _Unusable(f"{file_name} is unreadable ({error_line(exc)})") from None
            if actual != expected:
                raise _Unusable(f"sha256 mismatch in {file_name}")

    def _read_state(self, meta: CheckpointMeta) -> dict[str, Any]:
        if meta.format != TORCH_FORMAT:
            raise _Unusable(f"a {meta.format} checkpoint: it loads on every rank, not here")
        self._verify(meta)
        path = self.root / meta.name / STATE_FILE
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # whatever the unpickler raises, the checkpoint is unusable
            raise _Unusable(f"cannot load {STATE_FILE}: {error_line(exc)}") from None
        if not isinstance(state, dict):
            raise _Unusable(f"{STATE_FILE} holds a {type(state).__name__}, not a dict")
        return state
