"""Recovery: checkpoints and snapshots of every registered state, and putting them back.

Saving a payload through the run's checkpoint format (``checkpoint.formats``: ``torch`` or
``dcp``, chosen at start-up), copying one to host memory, and applying one on every rank for a
resume or a rollback, which every part of the agent then hears of (``restored.Restored``).
Collective under torchrun: every rank calls ``save``, ``take_snapshot`` and ``restore``
together.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lossguard.agent.checkpoint.formats import (
    CheckpointFormat,
    OnSaved,
    RestoreError,
    Stateful,
)
from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.distributed import all_gather_objects, all_reduce_max, collective
from lossguard.agent.dtensors import full_value
from lossguard.agent.restored import Restored, RestoreKind, Restores
from lossguard.agent.rng import restore_rng
from lossguard.agent.run_context import RunContext
from lossguard.common.control.protocol import ABANDONED, SkipBatches, Target
from lossguard.common.rundir.checkpoints import CheckpointMeta
from lossguard.common.rundir.events import (
    CHECKPOINT,
    CHECKPOINT_FAILED,
    ROLLBACK,
    SNAPSHOTS_OFF,
    SUPERSEDED,
)
from lossguard.common.rundir.targets import is_in_memory, is_superseded, named_states

log = logging.getLogger("lossguard.agent")

DETECTOR_STATE = "spikes/"


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


class Recovery:
    """Saves and restores every registered state (``state``, shared with the Guard) in the
    run's checkpoint ``format``.

    ``store`` is the checkpoint store on rank 0 and None elsewhere; ``snapshots`` this rank's
    in-memory snapshots (None: off; under sharding, of this rank's shards); ``healthy_now``
    says whether this rank is healthy at this boundary (docs/design.md ``last_good``);
    ``restores`` is told of every restore once it is complete.
    """

    def __init__(
        self,
        ctx: RunContext,
        state: dict[str, Stateful],
        progress: TrainProgress,
        *,
        format: CheckpointFormat,
        store: CheckpointStore | None,
        snapshots: SnapshotStore | None,
        async_save: bool,
        healthy_now: Callable[[], bool],
        restores: Restores,
    ) -> None:
        self.ctx = ctx
        self.state = state
        self.progress = progress
        self.format = format
        self.store = store
        self.snapshots = snapshots
        self.async_save = async_save
        self.healthy_now = healthy_now
        self.restores = restores
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
        self.format.close(failed=failed)

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
        """Checkpoint now, in the background unless ``wait`` or async saves are off; rank 0's
        ``on_done`` gets the meta or the error once the checkpoint is on disk."""
        if self.state_mixed:
            log.error("not saving: a failed restore left the state mixed")
            return
        payload, all_healthy = self.format.payload(self.state, self.healthy_now())
        step = self.progress.step
        self.last_saved_step = step  # on every rank: finish() must agree on the collective
        self.last_saved_at = time.monotonic()
        facts: dict[str, Any] = {
            "tokens": self.progress.tokens,
            "healthy": all_healthy if healthy is None else healthy,
            "reason": reason,
            "train_loss": train_loss,
            "val_loss": val_loss,
        }
        wait = wait or not self.async_save
        if self.store is None:
            self.format.write(payload, step, facts, wait=wait, on_done=None)
            return
        self.format.wait()  # at most one save in flight; its end must not clear this one's gauge
        started = time.perf_counter()
        self.ctx.telemetry.checkpoint_started()

        def finished(result: CheckpointMeta | BaseException) -> None:
            seconds = time.perf_counter() - started
            failed = isinstance(result, BaseException)
            self.ctx.telemetry.checkpoint_finished(None if failed else seconds, self.named)
            if isinstance(result, BaseException):
                log.error("checkpoint at step %d failed: %s", step, result)
                self.ctx.event(CHECKPOINT_FAILED, reason=reason, error=str(result))
            else:
                self.ctx.event(
                    CHECKPOINT,
                    name=result.name,
                    reason=reason,
                    seconds=seconds,
                    healthy=result.healthy,
                    checkpoint_step=result.step,
                )
            if on_done is not None:
                on_done(result)

        self.format.write(payload, step, facts, wait=wait, on_done=finished)

    def named(self) -> dict[str, CheckpointMeta | None]:
        """Rank 0: the states ``latest``, ``best`` and ``last_good`` mean, on disk or in memory."""
        disk = self.store.list() if self.store is not None else []
        return named_states(disk, self.snapshots.list() if self.snapshots else [])

    def take_snapshot(self, *, train_loss: float | None, val_loss: float | None) -> bool:
        """Copy the state to host memory (every rank, its own shards under sharding; collective
        like ``save``). A snapshot exists only if every rank took it: the first time the
        budget refuses one on any rank, snapshots turn off on every rank, audited and exported.
        False: not yet, ask again at the next boundary (``CheckpointFormat.snapshot_payload``)."""
        snapshots = self.snapshots
        if snapshots is None or not snapshots.enabled or self.state_mixed:
            return True
        taken = self.format.snapshot_payload(self.state, self.healthy_now())
        if taken is None:
            return False
        payload, all_healthy = taken
        refusal = snapshots.refusal(payload)
        refusals = all_gather_objects(refusal, self.ctx.group, "all_gather_object: snapshot budget")
        refused = [(rank, why) for rank, why in enumerate(refusals) if why is not None]
        if refused:
            rank, why = refused[0]
            reason = why if self.ctx.world_size == 1 else f"rank {rank}: {why}"
            snapshots.turn_off(reason)
            if self.ctx.main:
                log.warning("in-memory snapshots are off: %s", reason)
            self.ctx.event(SNAPSHOTS_OFF, reason=reason)
        else:
            snapshots.take(
                self.progress.step,
                payload,
                tokens=self.progress.tokens,
                healthy=all_healthy,
                train_loss=train_loss,
                val_loss=val_loss,
            )
        self.ctx.telemetry.snapshots(snapshots.enabled, snapshots.held_bytes)
        if self.store is not None:
            self.ctx.telemetry.states_changed(self.named)
        return True

    def restore(self, target: Target, *, skip_batches: SkipBatches = 0) -> CheckpointMeta:
        """Load a checkpoint into every registered state on every rank; then skip batches.
        A checkpoint that cannot be loaded raises RestoreError and changes nothing; one that
        fails halfway through being applied raises it with ``state_mixed`` set (its state
        would be a mix: training must stop)."""
        meta = self._restore(target, skip_batches)[0]
        self._restored(meta, "restore")
        return meta

    def _restore(
        self, target: Target, skip_batches: SkipBatches, before_step: int | None = None
    ) -> tuple[CheckpointMeta, int]:
        """``restore`` (preferring checkpoints before ``before_step``), untold; also returns
        how many batches were skipped."""
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
        meta, payload = self.format.load(target, before_step)
        absent = set(self.state) - set(payload["state"]) - self.format.apart
        missing = sorted(n for n in absent if not is_optional(n))
        if missing:
            raise RestoreError(f"{meta.name} has no state for {', '.join(missing)}")
        failure: Exception | None = None
        if self.snapshots is not None:  # a copy still in flight reads what is about to change
            self.snapshots.before_update()
        try:
            self.format.load_apart(meta, payload)
            self._apply(payload)
        except Exception as exc:
            failure = exc
        failed = all_reduce_max(
            [int(failure is not None)], self.ctx.group, "all_reduce: restore applied"
        )
        if failed[0]:  # every rank agrees
            self.state_mixed = True
            why = failure or "on another rank"
            raise RestoreError(
                f"{meta.name} failed halfway ({why}); training stops to protect the run"
            ) from failure
        self.last_saved_step = self.progress.step
        self.unclaimed = {n: v for n, v in payload["state"].items() if n not in self.state}
        skip = (
            skip_batches
            if isinstance(skip_batches, int)
            else _abandoned_batches(data, from_step, from_position, self.progress.step)
        )
        if skip:
            data.skip(skip)  # type: ignore[union-attr]
        self._leave_timeline(meta)
        return meta, skip

    def _restored(self, meta: CheckpointMeta, kind: RestoreKind) -> None:
        """Tell every listener that training goes on from ``meta``."""
        position = _position(self.state.get("data"))
        progress = self.progress
        self.restores.publish(Restored(meta, progress.step, progress.tokens, position, kind))

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
            self.ctx.event(SUPERSEDED, checkpoints=left, restored=meta.name)
        self.ctx.telemetry.states_changed(self.named)

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
        self._restored(meta, "rollback")
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
        if self.ctx.world_size > 1:
            result["ranks"] = self._digests()
        self.ctx.event(ROLLBACK, **result)
        log.warning("rolled back from step %d to step %d (%s)", from_step, meta.step, meta.name)
        return result

    def _digests(self) -> list[dict[str, Any]]:
        """Every rank's step and weights digest, by rank (collective)."""
        model = self.state["model"]
        assert isinstance(model, nn.Module)
        with collective("full_tensor: rollback weights digest"):  # sharded: all-gathers
            weights = weights_digest(model)
        mine = {"rank": self.ctx.rank, "step": self.progress.step, "weights": weights}
        return all_gather_objects(mine, self.ctx.group, "all_gather_object: rollback digests")

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
        """Optional state (detectors) first and forgivingly, then the training state; the
        states the format holds apart are loaded already."""
        for name, obj in sorted(self.state.items(), key=lambda item: not is_optional(item[0])):
            if name in self.format.apart:
                continue
            saved = payload["state"].get(name)
            if not is_optional(name):
                obj.load_state_dict(saved)
                continue
            try:
                obj.load_state_dict(saved)
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                log.warning("%s not restored (%s): it starts afresh", name, exc or "absent")
        rng = payload["rng"]
        world_size = self.ctx.world_size
        restore_rng(rng[self.ctx.rank] if len(rng) == world_size else rng[0])
