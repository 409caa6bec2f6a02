"""Applying control commands at a step boundary, identically on every rank.

Rank 0's control server queues validated requests; ``gather`` hands them (and whether any rank
got a stop signal) to every rank; ``apply`` runs the command everywhere and answers on rank 0.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .checkpoint import CheckpointMeta, CheckpointStore
from .control import PendingCommand
from .distributed import all_gather_objects, all_reduce_max, broadcast_objects
from .protocol import ErrorCode, Request, error_reply, ok_reply

if TYPE_CHECKING:
    from .guard import Guard

log = logging.getLogger("lossguard.agent")

PAUSED_WAIT_S = 0.2


class CommandFailed(Exception):
    """A valid command that could not be applied; becomes an ``ok: false`` reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Reply = Callable[[dict[str, Any] | CommandFailed], None]


def checkpoint_summary(store: CheckpointStore) -> dict[str, str | None]:
    """Names of the latest, best and last good checkpoints (None where there is none)."""
    return {kind: meta.name if meta else None for kind, meta in store.named().items()}


class CommandRunner:
    """The control half of Guard: gathers commands and applies them."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def gather(self, *, wait: bool) -> tuple[list[tuple[Request, PendingCommand | None]], bool]:
        """This boundary's commands, the same on every rank, and whether a rank was signalled."""
        guard = self.guard
        control = guard.control
        pending = control.take(PAUSED_WAIT_S if wait else 0.0) if control is not None else []
        count, signalled = all_reduce_max([len(pending), int(guard.signal_pending)], guard._group)
        requests = [p.request for p in pending]
        if count and guard.world_size > 1:
            requests = broadcast_objects([requests], guard._group)[0]
        handles: list[PendingCommand | None] = list(pending) or [None] * len(requests)
        return list(zip(requests, handles, strict=True)), bool(signalled)

    def apply(self, request: Request, pending: PendingCommand | None) -> None:
        """Run one command on this rank; rank 0 records it and answers the client."""

        def reply(outcome: dict[str, Any] | CommandFailed) -> None:
            if isinstance(outcome, CommandFailed):
                message = error_reply(request.id, outcome.code, outcome.message)
            else:
                message = ok_reply(request.id, outcome)
            self.guard.event(
                "command",
                id=request.id,
                cmd=request.cmd,
                args=request.args,
                ok=message["ok"],
                **({"result": outcome} if message["ok"] else {"error": message["error"]}),
            )
            if self.guard.telemetry is not None and self.guard.rank == 0:
                self.guard.telemetry.command_applied(request.cmd, message["ok"])
            if pending is not None:
                pending.resolve(message)

        handler = getattr(self, f"_{request.cmd}")
        try:
            result = handler(request.args, reply)
        except CommandFailed as exc:
            reply(exc)
            return
        except Exception as exc:  # a failing command must never take training down
            log.exception("control command %s failed", request.cmd)
            reply(CommandFailed(ErrorCode.FAILED, f"{type(exc).__name__}: {exc}"))
            return
        if result is not None:
            reply(result)

    # Each handler returns the result, or None when it replies later through ``reply``.

    def _status(self, args: dict[str, Any], reply: Reply) -> dict[str, Any]:
        guard = self.guard
        store = guard.checkpoints
        checkpoint: dict[str, Any] = checkpoint_summary(store) if store else {}
        checkpoint["in_progress"] = bool(store and store.in_progress)
        return {
            "run_id": guard.config.run.id or guard.path.name,
            "step": guard.step,
            "max_steps": guard.max_steps,
            "tokens": guard.tokens_total,
            "paused": guard.paused,
            "stopping": guard.stop_requested,
            "lr": guard.learning_rate(),
            "lr_scale": guard.lr_scale,
            "last_train_loss": guard.last_train_loss,
            "last_val_loss": guard.last_val[1] if guard.last_val else None,
            "world_size": guard.world_size,
            "pid": os.getpid(),
            "uptime_seconds": time.time() - guard.started_at,
            "checkpoint": checkpoint,
        }

    def _checkpoints(self, args: dict[str, Any], reply: Reply) -> dict[str, Any]:
        store = self.guard.checkpoints
        if store is None:
            return {}
        return {"checkpoints": [m.to_dict() for m in store.list()], **checkpoint_summary(store)}

    def _save(self, args: dict[str, Any], reply: Reply) -> None:
        started = time.perf_counter()

        def done(result: CheckpointMeta | BaseException) -> None:
            if isinstance(result, BaseException):
                reply(CommandFailed(ErrorCode.FAILED, f"checkpoint failed: {result}"))
                return
            seconds = time.perf_counter() - started
            reply(
                {
                    "name": result.name,
                    "step": result.step,
                    "healthy": result.healthy,
                    "seconds": seconds,
                }
            )

        self.guard.save("command", on_done=done)

    def _rollback(self, args: dict[str, Any], reply: Reply) -> dict[str, Any]:
        guard = self.guard
        from_step = guard.step
        from .guard import RestoreError, weights_digest

        try:
            restored = guard.restore(args["target"], skip_batches=args["skip_batches"])
        except RestoreError as exc:
            code = ErrorCode.NOT_FOUND if exc.not_found else ErrorCode.FAILED
            raise CommandFailed(code, str(exc)) from None
        guard.set_lr_scale(guard.lr_scale * args["lr_scale"])
        result: dict[str, Any] = {
            "from_step": from_step,
            "to_step": restored["step"],
            "checkpoint": restored["checkpoint"],
            "skipped_batches": args["skip_batches"],
            "lr_scale": guard.lr_scale,
        }
        if guard.world_size > 1:
            mine = {"rank": guard.rank, "step": guard.step, "weights": weights_digest(guard.model)}
            result["ranks"] = all_gather_objects(mine, guard._group)
        guard.event("rollback", **result)
        log.warning(
            "rolled back from step %d to step %d (%s)", from_step, guard.step, result["checkpoint"]
        )
        return result

    def _pause(self, args: dict[str, Any], reply: Reply) -> dict[str, Any]:
        self.guard.set_paused(True)
        return {"step": self.guard.step, "paused": True}

    def _resume(self, args: dict[str, Any], reply: Reply) -> dict[str, Any]:
        self.guard.set_paused(False)
        return {"step": self.guard.step, "paused": False}

    def _set_lr_scale(self, args: dict[str, Any], reply: Reply) -> dict[str, Any]:
        self.guard.set_lr_scale(float(args["scale"]))
        return {"lr_scale": self.guard.lr_scale, "lr": self.guard.learning_rate()}

    def _stop(self, args: dict[str, Any], reply: Reply) -> None:
        self.stop(reason="stop", reply=reply)

    def stop(self, *, reason: str, reply: Reply | None = None) -> None:
        """Save, then ask the loop to end (``guard.stop_requested``)."""
        guard = self.guard
        saved: list[str | None] = [None]

        def done(result: CheckpointMeta | BaseException) -> None:
            saved[0] = None if isinstance(result, BaseException) else result.name

        guard.save(reason, wait=True, on_done=done)
        guard.stop_requested = True
        guard.set_paused(False)
        log.info("stopping at step %d (%s)", guard.step, reason)
        if reply is not None:
            reply({"step": guard.step, "checkpoint": saved[0]})
