"""Checkpoint formats: how the registered state becomes a checkpoint, and comes back.

``Recovery`` goes one way through a ``CheckpointFormat``, chosen once at start-up
(``run_start.start_recovery``): ``torch`` (``torch_format.TorchFormat``: the whole payload in
one file, written by rank 0 through the ``CheckpointStore``) for plain and DDP models, ``dcp``
(``sharded_format.DcpFormat``: ``torch.distributed.checkpoint``, every rank writing its shards)
for sharded FSDP2 / HSDP models. Either also gives the payload of an in-memory snapshot and
restores one. Collective under torchrun: every rank calls ``payload``, ``write`` and ``load``
together.

A payload is ``{"format", "world_size", "rng", "state"}``: the registered state dicts by name
(less those the format holds ``apart``, in its own files) and RNG states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.distributed import all_reduce_max, broadcast_objects
from lossguard.common.control.protocol import Target
from lossguard.common.rundir.checkpoints import CheckpointMeta

CHECKPOINT_FORMAT = 2
"""1: step, tokens and lr_scale beside the state; 2: inside it, as the ``progress`` state."""
PROGRESS_STATE = "progress"

OnSaved = Callable[[CheckpointMeta | BaseException], None]
"""Told of a save once it is on disk: its meta, or the error."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


class RestoreError(RuntimeError):
    """A checkpoint could not be restored; the message names it and why. ``not_found``: no
    usable checkpoint matched the target; ``bad_request``: the arguments cannot apply to this
    run (nothing was loaded)."""

    def __init__(self, message: str, *, not_found: bool = False, bad_request: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found
        self.bad_request = bad_request


class CheckpointFormat(Protocol):
    """How a run's checkpoints and snapshots hold its registered state."""

    apart: frozenset[str]
    """Registered states the format saves and loads itself, outside the payload's ``state``."""

    def payload(self, state: Mapping[str, Stateful], healthy: bool) -> tuple[dict[str, Any], bool]:
        """This rank's payload of a checkpoint, and whether every rank is ``healthy``."""
        ...

    def snapshot_payload(
        self, state: Mapping[str, Stateful], healthy: bool
    ) -> tuple[dict[str, Any], bool] | None:
        """``payload`` for an in-memory snapshot; None: none can be taken yet."""
        ...

    def wait(self) -> None:
        """Rank 0, before a save: until the save in flight is done."""
        ...

    def write(
        self,
        payload: dict[str, Any],
        step: int,
        facts: dict[str, Any],
        *,
        wait: bool,
        on_done: OnSaved | None,
    ) -> None:
        """Save the checkpoint of ``step`` (``facts``: ``meta_fields``' tokens, healthy, reason,
        train_loss, val_loss) now (``wait``) or in the background; rank 0 tells ``on_done``."""
        ...

    def load(
        self, target: Target, before_step: int | None
    ) -> tuple[CheckpointMeta, dict[str, Any]]:
        """The state ``target`` means (rank 0 chooses it) and this rank's payload of it, in the
        current payload format; RestoreError when there is none. Changes nothing."""
        ...

    def load_apart(self, meta: CheckpointMeta, payload: dict[str, Any]) -> None:
        """Load the states held ``apart`` from ``meta`` (``payload``: this rank's of it)."""
        ...

    def close(self, *, failed: bool) -> None:
        """Wait for the saves in flight (after a failure, not the collective ones)."""
        ...


def versioned(world_size: int, rng: list[Any], states: dict[str, Any]) -> dict[str, Any]:
    """A payload of ``states`` (state dicts by name) and ``rng`` (RNG states, by rank)."""
    return {"format": CHECKPOINT_FORMAT, "world_size": world_size, "rng": rng, "state": states}


def state_dicts(state: Mapping[str, Stateful], apart: frozenset[str]) -> dict[str, Any]:
    """Every registered state's state dict but those held ``apart``."""
    return {name: obj.state_dict() for name, obj in state.items() if name not in apart}


def upgraded(payload: dict[str, Any], name: str) -> dict[str, Any]:
    """Checkpoint ``name``'s payload in the current format; format 1 kept the progress beside
    the state."""
    version = payload.get("format", 1)
    if version == CHECKPOINT_FORMAT:
        return payload
    if version != 1:
        raise RestoreError(f"{name}: checkpoint format {version} is newer than this lossguard")
    progress = {key: payload[key] for key in ("step", "tokens", "lr_scale")}
    return {**payload, "state": {**payload["state"], PROGRESS_STATE: progress}}


def chosen_by_main(choose: Callable[[], Any] | None, group: Any) -> Any:
    """What rank 0 ``choose``s to restore (None on the other ranks), on every rank; a choice
    that failed raises RestoreError (``not_found``) with its message on every rank."""
    chosen: list[Any] = [None]
    if choose is not None:
        try:
            chosen = [choose()]
        except Exception as exc:
            chosen = [f"{exc}"]
    chosen = broadcast_objects(chosen, group, "broadcast_object_list: checkpoint to restore")
    if isinstance(chosen[0], str):
        raise RestoreError(chosen[0], not_found=True)
    return chosen[0]


def from_memory(snapshots: SnapshotStore | None, name: str, group: Any) -> dict[str, Any]:
    """This rank's snapshot ``name`` (every rank has it, or the restore changes nothing)."""
    payload: dict[str, Any] | None = None
    if snapshots is not None:
        with contextlib.suppress(KeyError):
            payload = snapshots.payload(name)
    missing = all_reduce_max([int(payload is None)], group, "all_reduce: snapshot in memory")
    if missing[0]:
        raise RestoreError(f"snapshot {name} is not in memory on every rank", not_found=True)
    assert payload is not None
    return payload
