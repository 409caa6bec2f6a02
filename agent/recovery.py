"""Recovery: checkpoints of every registered state, and putting them back.

Building a payload (every registered state dict, the RNG states of all ranks, the health of all
ranks), saving it through the checkpoint store, and applying one on every rank for a resume or a
rollback. Collective under torchrun: every rank calls ``save`` and ``restore`` together.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from lossguard.agent.checkpoint.dcp_format import SHARDED_STATE, WORLD_SIZE, DcpCheckpoints
from lossguard.agent.checkpoint.snapshot import snapshot
from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.distributed import (
    all_gather_objects,
    all_reduce_max,
    broadcast_objects,
    collective,
)
from lossguard.agent.dtensors import full_value
from lossguard.agent.rng import capture_rng, restore_rng
from lossguard.agent.telemetry.collector import Telemetry
from lossguard.common.control.protocol import ABANDONED, SkipBatches, Target
from lossguard.common.rundir.checkpoints import DCP_FORMAT, CheckpointMeta, meta_fields
from lossguard.common.rundir.events import (
    CHECKPOINT,
    CHECKPOINT_FAILED,
    RESHARDED,
    ROLLBACK,
    SNAPSHOTS_OFF,
    SUPERSEDED,
)
from lossguard.common.rundir.targets import is_in_memory, is_superseded, named_states

log = logging.getLogger("lossguard.agent")

CHECKPOINT_FORMAT = 2
"""1: step, tokens and lr_scale beside the state; 2: inside it, as the ``progress`` state."""
PROGRESS_STATE = "progress"
DETECTOR_STATE = "spikes/"


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


class TrainProgress:
    """Where training stands: optimizer steps done, tokens trained on, and the learning-rate
    scale set by control commands. Registered state, so checkpoints carry it."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = 0
        self.lr_scale = 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.lr_scale = float(state["lr_scale"])


def weights_digest(model: nn.Module) -> str:
    """sha256 of the model's tensors: equal on every rank that holds the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):  # sharded: collective
        digest.update(name.encode())
        digest.update(
            full_value(tensor.detach())
            .cpu()
            .reshape(-1)
            .contiguous()
            .view(torch.uint8)
            .numpy()
            .tobytes()
        )
    return digest.hexdigest()


def is_optional(state_name: str) -> bool:
    """Detector state: a checkpoint without it (or from other settings) still restores."""
    return state_name.startswith(DETECTOR_STATE)


def _upgraded(payload: dict[str, Any], name: str) -> dict[str, Any]:
    """Checkpoint ``name``'s payload in the current format; format 1 kept the progress beside
    the state."""
    version = payload.get("format", 1)
    if version == CHECKPOINT_FORMAT:
        return payload
    if version != 1:
        raise RestoreError(f"{name}: checkpoint format {version} is newer than this lossguard")
    progress = {key: payload[key] for key in ("step", "tokens", "lr_scale")}
    return {**payload, "state": {**payload["state"], PROGRESS_STATE: progress}}


def _position(data: Stateful | None) -> int | None:
    position = getattr(data, "position", None)
    return None if position is None else int(position)


def _batches_per_step(data: Stateful | None) -> int | None:
    per_step = getattr(data, "batches_per_step", None)
    return None if per_step is None else int(per_step)


def _abandoned_batches(
    data: Stateful | None, from_step: int, from_position: int | None, to_step: int
) -> int:
    """The batches the abandoned steps trained on: the data position before the restore less
    the restored one; without a position, the steps rolled back times ``batches_per_step``.
    Never below 0 (a restore forward, onto a superseded timeline, abandons no batches)."""
    now = _position(data)
    if from_position is not None and now is not None:
        return max(0, from_position - now)
    per_step = _batches_per_step(data)
    assert per_step is not None  # checked before anything was loaded
    return max(0, (from_step - to_step) * per_step)


Events = Callable[..., None]
OnSaved = Callable[[CheckpointMeta | BaseException], None]


class Recovery:
    """Saves and restores every registered state (``state``, shared with the Guard).

    ``store`` is the checkpoint store on rank 0 and None elsewhere; ``snapshots`` this rank's
    in-memory snapshots (None: off; under sharding, of this rank's shards); ``sharded``, for a
    sharded model, writes and reads ``dcp`` checkpoints on every rank
    (``checkpoint.dcp_format``); ``healthy_now`` says whether this rank is healthy at this
    boundary (docs/design.md ``last_good``); ``on_restored`` runs after every restore; ``event``
    appends to the audit trail.
    """

    def __init__(
        self,
        state: dict[str, Stateful],
        progress: TrainProgress,
        *,
        store: CheckpointStore | None,
        snapshots: SnapshotStore | None,
        group: Any,
        rank: int,
        world_size: int,
        async_save: bool,
        telemetry: Telemetry | None,
        healthy_now: Callable[[], bool],
        on_restored: Callable[[CheckpointMeta], None],
        event: Events,
        sharded: DcpCheckpoints | None = None,
    ) -> None:
        self.state = state
        self.sharded = sharded
        """Under FSDP2 / HSDP: ``dcp`` checkpoints, which every rank writes and reads."""
        self.progress = progress
        self.store = store
        self.snapshots = snapshots
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.async_save = async_save
        self.telemetry = telemetry
        self.healthy_now = healthy_now
        self.on_restored = on_restored
        self.event = event
        self.last_saved_step: int | None = None
        self.last_saved_at = time.monotonic()  # the time cadence counts from the start
        self.state_mixed = False  # a restore failed halfway: this state must never be saved
        self.unclaimed: dict[str, Any] = {}
        """State in the last restored checkpoint under names not registered (yet)."""

    def register(self, name: str, obj: Stateful) -> None:
        """Add state that checkpoints carry; registered after a restore and before the next
        step, it gets the state the checkpoint holds under ``name``."""
        if name in self.state:
            raise ValueError(f"state {name!r} is already registered")
        self.state[name] = obj
        saved = self.unclaimed.pop(name, None)
        if saved is not None:
            obj.load_state_dict(saved)

    def close(self, *, failed: bool) -> None:
        """Wait for the saves in flight (after a failure, not the collective ``dcp`` ones)."""
        if self.sharded is not None and not failed:  # its writes are collective
            self.sharded.close()
        if self.store is not None:
            self.store.wait()

    def payload(self) -> tuple[dict[str, Any], bool]:
        """Everything a bit-exact resume needs, and whether every rank is healthy now.
        Collective under torchrun: the RNG states and health of all ranks are gathered."""
        state = (capture_rng(), self.healthy_now())
        gathered = all_gather_objects(state, self.group, "all_gather_object: RNG states and health")
        payload = {
            "format": CHECKPOINT_FORMAT,
            "world_size": self.world_size,
            "rng": [rng for rng, _ in gathered],
            "state": {name: obj.state_dict() for name, obj in self.state.items()},
        }
        return payload, all(healthy for _, healthy in gathered)

    def rank_payload(self) -> tuple[dict[str, Any], bool]:
        """A sharded run's per-rank part of a checkpoint (all but the sharded model and
        optimizer, and this rank's RNG states), and whether every rank is healthy now."""
        gathered = all_gather_objects(self.healthy_now(), self.group, "all_gather_object: health")
        payload = {
            "format": CHECKPOINT_FORMAT,
            "world_size": self.world_size,
            "rng": [capture_rng()],
            "state": {
                name: obj.state_dict()
                for name, obj in self.state.items()
                if name not in SHARDED_STATE
            },
        }
        return payload, all(gathered)

    def save(
        self,
        reason: str,
        *,
        healthy: bool | None,
        train_loss: float | None,
        val_loss: float | None,
        wait: bool,
        on_done: OnSaved | None,
    ) -> None:
        """Checkpoint now (rank 0 writes), in the background unless ``wait`` or async saves
        are off; ``on_done`` gets the meta or the error once the checkpoint is on disk."""
        if self.state_mixed:
            log.error("not saving: a failed restore left the state mixed")
            return
        payload, all_healthy = self.payload() if self.sharded is None else self.rank_payload()
        step = self.progress.step
        self.last_saved_step = step  # on every rank: finish() must agree on the collective
        self.last_saved_at = time.monotonic()
        if self.store is None:
            if self.sharded is not None:  # every rank writes its shards; rank 0 the meta
                fields = meta_fields(step, 0, False, reason, None, None, None)  # for the name
                self.sharded.save(payload, fields, wait=wait or not self.async_save, on_done=None)
            return
        store = self.store
        fields_in: dict[str, Any] = {
            "tokens": self.progress.tokens,
            "healthy": all_healthy if healthy is None else healthy,
            "reason": reason,
            "train_loss": train_loss,
            "val_loss": val_loss,
        }
        store.wait()  # at most one save in flight; its end must not clear this one's gauge
        if self.sharded is not None:
            self.sharded.wait()
        started = time.perf_counter()
        if self.telemetry is not None:
            self.telemetry.checkpoint_started()

        def finished(result: CheckpointMeta | BaseException) -> None:
            seconds = time.perf_counter() - started
            failed = isinstance(result, BaseException)
            if self.telemetry is not None:
                self.telemetry.checkpoint_finished(None if failed else seconds, self.named())
            if isinstance(result, BaseException):
                log.error("checkpoint at step %d failed: %s", step, result)
                self.event(CHECKPOINT_FAILED, reason=reason, error=str(result))
            else:
                self.event(
                    CHECKPOINT,
                    name=result.name,
                    reason=reason,
                    seconds=seconds,
                    healthy=result.healthy,
                    checkpoint_step=result.step,
                )
            if on_done is not None:
                on_done(result)

        if self.sharded is not None:
            fields = meta_fields(step, extra=None, **fields_in)
            self.sharded.save(payload, fields, wait=wait or not self.async_save, on_done=finished)
            return
        if self.async_save and not wait:
            store.save_async(step, snapshot(payload), on_done=finished, **fields_in)
            return
        try:
            meta = store.save(step, payload, **fields_in)
        except Exception as exc:  # a failed save must not stop training
            finished(exc)
            return
        finished(meta)

    def named(self) -> dict[str, CheckpointMeta | None]:
        """Rank 0: the states ``latest``, ``best`` and ``last_good`` mean, on disk or in memory."""
        disk = self.store.list() if self.store is not None else []
        return named_states(disk, self.snapshots.list() if self.snapshots else [])

    def take_snapshot(self, *, train_loss: float | None, val_loss: float | None) -> bool:
        """Copy the state to host memory (every rank, its own shards under sharding; collective
        like ``payload``). A snapshot exists only if every rank took it: the first time the
        budget refuses one on any rank, snapshots turn off on every rank, audited and exported.
        False: not yet, ask again at the next boundary (a sharded optimizer before its first
        step, whose state ``get_state_dict`` would make by stepping it)."""
        snapshots = self.snapshots
        if snapshots is None or not snapshots.enabled or self.state_mixed:
            return True
        if self.sharded is not None and self.sharded.sharded.before_first_step():
            return False
        payload, all_healthy = self.payload() if self.sharded is None else self.rank_payload()
        if self.sharded is not None:
            payload["state"].update(self.sharded.sharded.state_dict())
        refusal = snapshots.refusal(payload)
        refusals = all_gather_objects(refusal, self.group, "all_gather_object: snapshot budget")
        refused = [(rank, why) for rank, why in enumerate(refusals) if why is not None]
        if refused:
            rank, why = refused[0]
            reason = why if self.world_size == 1 else f"rank {rank}: {why}"
            snapshots.turn_off(reason)
            if self.rank == 0:
                log.warning("in-memory snapshots are off: %s", reason)
            self.event(SNAPSHOTS_OFF, reason=reason)
        else:
            snapshots.take(
                self.progress.step,
                payload,
                tokens=self.progress.tokens,
                healthy=all_healthy,
                train_loss=train_loss,
                val_loss=val_loss,
            )
        if self.telemetry is not None:
            self.telemetry.snapshots(snapshots.enabled, snapshots.held_bytes)
            if self.store is not None:
                self.telemetry.states_changed(self.named())
        return True

    def restore(self, target: Target, *, skip_batches: SkipBatches = 0) -> CheckpointMeta:
        """Load a checkpoint into every registered state on every rank; then skip batches.
        A checkpoint that cannot be loaded raises RestoreError and changes nothing; one that
        fails halfway through being applied raises it with ``state_mixed`` set (its state
        would be a mix: training must stop)."""
        return self._restore(target, skip_batches)[0]

    def _restore(
        self, target: Target, skip_batches: SkipBatches, before_step: int | None = None
    ) -> tuple[CheckpointMeta, int]:
        """``restore`` (preferring checkpoints before ``before_step``); also returns how many
        batches were skipped."""
        data = self.state.get("data")
        if skip_batches and (data is None or not hasattr(data, "skip")):
            raise RestoreError(
                "skip_batches needs registered data with a skip() method", bad_request=True
            )
        from_step, from_position = self.progress.step, _position(data)
        if skip_batches == ABANDONED and from_position is None and _batches_per_step(data) is None:
            raise RestoreError(
                f"skip_batches {ABANDONED!r} needs registered data with a position attribute "
                "(or a batches_per_step one), to know which batches the abandoned steps used",
                bad_request=True,
            )
        meta, payload = (
            self._load_whole(target, before_step)
            if self.sharded is None
            else self._load_sharded(target, before_step)
        )
        in_dcp = set(SHARDED_STATE) if self.sharded is not None else set()
        absent = set(self.state) - set(payload["state"]) - in_dcp
        missing = sorted(n for n in absent if not is_optional(n))
        if missing:
            raise RestoreError(f"{meta.name} has no state for {', '.join(missing)}")
        failure: Exception | None = None
        if self.snapshots is not None:  # a copy still in flight reads what is about to change
            self.snapshots.before_update()
        try:
            if self.sharded is not None and is_in_memory(meta):
                self.sharded.sharded.load_copy(payload["state"])
            elif self.sharded is not None:
                self.sharded.load_sharded(meta)
            self._apply(payload)
        except Exception as exc:
            failure = exc
        failed = all_reduce_max(
            [int(failure is not None)], self.group, "all_reduce: restore applied"
        )
        if failed[0]:  # every rank agrees
            self.state_mixed = True
            why = failure or "on another rank"
            raise RestoreError(
                f"{meta.name} failed halfway ({why}); training stops to protect the run"
            ) from failure
        self.last_saved_step = self.progress.step
        self.unclaimed = {n: v for n, v in payload["state"].items() if n not in self.state}
        self.on_restored(meta)
        skip = (
            skip_batches
            if isinstance(skip_batches, int)
            else _abandoned_batches(data, from_step, from_position, self.progress.step)
        )
        if skip:
            data.skip(skip)  # type: ignore[union-attr]
        self._leave_timeline(meta)
        return meta, skip

    def _load_whole(
        self, target: Target, before_step: int | None
    ) -> tuple[CheckpointMeta, dict[str, Any]]:
        """A ``torch`` checkpoint, rank 0 loads it and every rank gets its payload; or an
        in-memory snapshot, each rank's own."""
        loaded: list[Any] = [None]
        if self.store is not None:
            self.store.wait()
            memory = self.snapshots.list() if self.snapshots is not None else []
            try:
                meta, payload = self.store.load_or_snapshot(target, before_step, memory)
                loaded = [{"meta": meta, "payload": payload}]
            except Exception as exc:
                loaded = [f"{exc}"]
        loaded = broadcast_objects(
            loaded, self.group, "broadcast_object_list: checkpoint to restore"
        )
        if isinstance(loaded[0], str):
            raise RestoreError(loaded[0], not_found=True)
        meta = loaded[0]["meta"]
        payload = loaded[0]["payload"]
        if payload is None:  # a snapshot: each rank takes its own from memory
            payload = self._from_memory(meta.name)
        return meta, _upgraded(payload, meta.name)

    def _load_sharded(
        self, target: Target, before_step: int | None
    ) -> tuple[CheckpointMeta, dict[str, Any]]:
        """A ``dcp`` checkpoint, verified by rank 0, and this rank's payload (the sharded
        state is read when applied); or an in-memory snapshot, each rank's own shards."""
        assert self.sharded is not None
        self.sharded.wait()
        chosen: list[Any] = [None]
        if self.store is not None:
            memory = self.snapshots.list() if self.snapshots is not None else []
            try:
                chosen = [self.store.load_verified(target, before_step, memory)]
            except Exception as exc:
                chosen = [f"{exc}"]
        chosen = broadcast_objects(
            chosen, self.group, "broadcast_object_list: checkpoint to restore"
        )
        if isinstance(chosen[0], str):
            raise RestoreError(chosen[0], not_found=True)
        meta: CheckpointMeta = chosen[0]
        if is_in_memory(meta):
            return meta, _upgraded(self._from_memory(meta.name), meta.name)
        if meta.format != DCP_FORMAT:
            raise RestoreError(
                f"{meta.name} is a {meta.format} checkpoint of a model that was not sharded; "
                f"this sharded run loads {DCP_FORMAT} checkpoints"
            )
        payload = self.sharded.rank_payload(meta)
        saved_world = int(meta.extra.get(WORLD_SIZE, 1))
        if saved_world != self.world_size and self.rank == 0:
            message = (
                f"{meta.name} was written by {saved_world} ranks and loads on {self.world_size}: "
                "model and optimizer state are resharded exactly, but the per-rank RNG states "
                "(dropout), detector windows and data streams are not (a rank without its own "
                "takes rank 0's): training goes on, it does not replay bit for bit"
            )
            log.warning("%s", message)
            self.event(RESHARDED, checkpoint=meta.name, saved_world_size=saved_world)
        return meta, _upgraded(payload, meta.name)

    def _from_memory(self, name: str) -> dict[str, Any]:
        """This rank's snapshot ``name`` (every rank has it, or the restore changes nothing)."""
        payload: dict[str, Any] | None = None
        if self.snapshots is not None:
            with contextlib.suppress(KeyError):
                payload = self.snapshots.payload(name)
        missing = all_reduce_max(
            [int(payload is None)], self.group, "all_reduce: snapshot in memory"
        )
        if missing[0]:
            raise RestoreError(f"snapshot {name} is not in memory on every rank", not_found=True)
        assert payload is not None
        return payload

    def _leave_timeline(self, meta: CheckpointMeta) -> None:
        """After a restore: later checkpoints and snapshots belong to the timeline we left
        (every snapshot, when ``meta`` itself was on an abandoned one)."""
        if self.snapshots is not None:
            if is_superseded(meta) and not is_in_memory(meta):
                self.snapshots.clear()
            else:
                self.snapshots.discard_after(meta.step)
        if self.store is None:
            return
        left = self.store.supersede_after(meta)
        if left:
            self.event(SUPERSEDED, checkpoints=left, restored=meta.name)
        if self.telemetry is not None:
            self.telemetry.states_changed(self.named())

    def rollback(
        self,
        target: Target,
        *,
        skip_batches: SkipBatches,
        lr_scale: float,
        episode: dict[str, Any] | None = None,
        trouble_since: int | None = None,
    ) -> dict[str, Any]:
        """Restore ``target``, pass over ``skip_batches`` batches (``"abandoned"``: those the
        abandoned steps trained on) and set the learning-rate scale to the one in force before
        the rollback times ``lr_scale`` (two rollbacks to one state at 0.5 make 0.25);
        audited, and what the ``rollback`` command answers. ``episode``: the diagnosis of the
        latest spike or non-finite value, answered as ``abandoned`` when it lies in the
        abandoned steps. ``trouble_since``: the step where the unrecovered spike episode being
        abandoned began; a named target then prefers checkpoints from before the step ahead of
        it, since the update of that step may be what made the loss spike. Under torchrun the
        answer carries every rank's step and weights digest."""
        from_step, scale_in_force = self.progress.step, self.progress.lr_scale
        before = (
            trouble_since - 1 if trouble_since is not None and isinstance(target, str) else None
        )
        meta, skipped = self._restore(target, skip_batches, before)
        # of the scale in force, not the restored one: rollbacks to one state compound
        self.set_lr_scale(scale_in_force * lr_scale)
        to_step = self.progress.step
        abandoned = episode if episode is not None and episode["step"] > to_step else None
        result: dict[str, Any] = {
            "from_step": from_step,
            "to_step": to_step,
            "checkpoint": meta.name,
            "skipped_batches": skipped,
            "lr_scale": self.progress.lr_scale,
            "abandoned": abandoned,
        }
        if self.world_size > 1:
            model = self.state["model"]
            assert isinstance(model, nn.Module)
            with collective("full_tensor: rollback weights digest"):  # sharded: all-gathers
                weights = weights_digest(model)
            mine = {"rank": self.rank, "step": self.progress.step, "weights": weights}
            result["ranks"] = all_gather_objects(
                mine, self.group, "all_gather_object: rollback digests"
            )
        self.event(ROLLBACK, **result)
        log.warning("rolled back from step %d to step %d (%s)", from_step, meta.step, meta.name)
        return result

    def set_lr_scale(self, scale: float) -> None:
        """Multiply the learning rate by ``scale`` relative to the schedule, from now on: the
        optimizer's current rates and the scheduler's base rates alike."""
        ratio = scale / self.progress.lr_scale
        for group in getattr(self.state.get("optimizer"), "param_groups", ()):
            group["lr"] *= ratio
        scheduler = self.state.get("scheduler")
        base_lrs = getattr(scheduler, "base_lrs", None)
        if base_lrs is not None:
            scheduler.base_lrs = [b * ratio for b in base_lrs]  # type: ignore[union-attr]
        self.progress.lr_scale = scale

    def _apply(self, payload: dict[str, Any]) -> None:
        """Optional state (detectors) first and forgivingly, then the training state."""
        for name, obj in sorted(self.state.items(), key=lambda item: not is_optional(item[0])):
            if self.sharded is not None and name in SHARDED_STATE:
                continue  # loaded by DCP
            saved = payload["state"].get(name)
            if not is_optional(name):
                obj.load_state_dict(saved)
                continue
            try:
                obj.load_state_dict(saved)
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                log.warning("%s not restored (%s): it starts afresh", name, exc or "absent")
        rng = payload["rng"]
        restore_rng(rng[self.rank] if len(rng) == self.world_size else rng[0])
