"""Applying control commands at a step boundary, identically on every rank.

Rank 0's control server queues validated requests; ``gather`` hands them (and whether any rank
got a stop signal) to every rank; ``apply`` runs the command everywhere and answers on rank 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from lossguard.agent.checkpoint.formats import OnSaved, RestoreError
from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.distributed import all_reduce_max, broadcast_objects
from lossguard.agent.run_context import RunContext
from lossguard.common.control.protocol import (
    ErrorCode,
    Request,
    SkipBatches,
    Target,
    error_reply,
    ok_reply,
)
from lossguard.common.control.server import ControlServer, PendingCommand
from lossguard.common.rundir.checkpoints import CheckpointMeta
from lossguard.common.rundir.events import COMMAND
from lossguard.common.rundir.targets import listing, named_states

log = logging.getLogger("lossguard.agent")

PAUSED_WAIT_S = 0.2
GATHER = "all_reduce: commands and signals"
BROADCAST = "broadcast_object_list: commands"


class Controllable(Protocol):
    """What commands act on: the training loop's Guard, as the control side sees it."""

    @property
    def step(self) -> int: ...
    @property
    def lr_scale(self) -> float: ...
    @property
    def untrained(self) -> bool: ...

    stop_requested: bool

    def status(self) -> dict[str, Any]: ...
    def learning_rate(self) -> float | None: ...
    def save(
        self, reason: str = ..., *, wait: bool = ..., on_done: OnSaved | None = ...
    ) -> None: ...
    def rollback(
        self, target: Target, *, skip_batches: SkipBatches, lr_scale: float
    ) -> dict[str, Any]: ...
    def set_paused(self, paused: bool) -> None: ...
    def set_lr_scale(self, scale: float) -> None: ...
    def expect_change(
        self, reason: str = ..., *, request_id: str | None = ...
    ) -> dict[str, Any]: ...
    def event(self, kind: str, /, **fields: Any) -> None: ...


class CommandFailed(Exception):
    """A valid command that could not be applied; becomes an ``ok: false`` reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Reply = Callable[[dict[str, Any] | CommandFailed], None]


def checkpoint_summary(
    store: CheckpointStore, snapshots: SnapshotStore | None
) -> dict[str, str | None]:
    """Names of the latest, best and last good states, on disk or in memory (None: none)."""
    named = named_states(store.list(), snapshots.list() if snapshots else [])
    return {kind: meta.name if meta else None for kind, meta in named.items()}


class CommandRunner:
    """The control half of the Guard: gathers commands and applies them to ``target``.
    ``control`` and ``store`` are rank 0's (None elsewhere); ``snapshots`` the in-memory ones."""

    def __init__(
        self,
        target: Controllable,
        ctx: RunContext,
        *,
        control: ControlServer | None,
        store: CheckpointStore | None,
        snapshots: SnapshotStore | None,
    ) -> None:
        self.target = target
        self.ctx = ctx
        self.control = control
        self.store = store
        self.snapshots = snapshots

    def gather(
        self, *, wait: bool, signalled: int
    ) -> tuple[list[tuple[Request, PendingCommand | None]], int]:
        """This boundary's commands, the same on every rank, and the largest stop-signal kind
        of any rank (``signalled``: this one's, ``StopSignals.kind``)."""
        control = self.control
        pending = control.take(PAUSED_WAIT_S if wait else 0.0) if control is not None else []
        group = self.ctx.group
        count, any_signalled = all_reduce_max([len(pending), signalled], group, GATHER)
        requests = [p.request for p in pending]
        if count and self.ctx.world_size > 1:
            (requests,) = broadcast_objects([requests], group, BROADCAST)
        handles: list[PendingCommand | None] = list(pending) or [None] * len(requests)
        return list(zip(requests, handles, strict=True)), int(any_signalled)

    def apply(self, request: Request, pending: PendingCommand | None) -> None:
        """Run one command on this rank; rank 0 records it and answers the client."""

        def reply(outcome: dict[str, Any] | CommandFailed) -> None:
            if isinstance(outcome, CommandFailed):
                message = error_reply(request.id, outcome.code, outcome.message)
            else:
                message = ok_reply(request.id, outcome)
            self.target.event(
                COMMAND,
                id=request.id,
                cmd=request.cmd,
                args=request.args,
                ok=message["ok"],
                **({"result": outcome} if message["ok"] else {"error": message["error"]}),
            )
            if self.ctx.main:
                self.ctx.telemetry.command_applied(request.cmd, message["ok"])
            if pending is not None:
                pending.resolve(message)

        handler = getattr(self, f"_{request.cmd}")
        try:
            result = handler(request, reply)
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

    def _status(self, request: Request, reply: Reply) -> dict[str, Any]:
        store = self.store
        checkpoint: dict[str, Any] = checkpoint_summary(store, self.snapshots) if store else {}
        checkpoint["in_progress"] = bool(store and store.in_progress)
        return {**self.target.status(), "checkpoint": checkpoint}

    def _checkpoints(self, request: Request, reply: Reply) -> dict[str, Any]:
        store = self.store
        if store is None:
            return {}
        return listing(store.list(), self.snapshots.list() if self.snapshots else [])

    def _save(self, request: Request, reply: Reply) -> None:
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

        self.target.save("command", on_done=done)

    def _rollback(self, request: Request, reply: Reply) -> dict[str, Any]:
        args = request.args
        try:
            return self.target.rollback(
                args["target"], skip_batches=args["skip_batches"], lr_scale=args["lr_scale"]
            )
        except RestoreError as exc:
            code = (
                ErrorCode.NOT_FOUND
                if exc.not_found
                else ErrorCode.BAD_REQUEST
                if exc.bad_request
                else ErrorCode.FAILED
            )
            raise CommandFailed(code, str(exc)) from None

    def _pause(self, request: Request, reply: Reply) -> dict[str, Any]:
        self.target.set_paused(True)
        return {"step": self.target.step, "paused": True}

    def _resume(self, request: Request, reply: Reply) -> dict[str, Any]:
        self.target.set_paused(False)
        return {"step": self.target.step, "paused": False}

    def _set_lr_scale(self, request: Request, reply: Reply) -> dict[str, Any]:
        self.target.set_lr_scale(float(request.args["scale"]))
        return {"lr_scale": self.target.lr_scale, "lr": self.target.learning_rate()}

    def _expect_change(self, request: Request, reply: Reply) -> dict[str, Any]:
        return self.target.expect_change(request.args["reason"], request_id=request.id)

    def _stop(self, request: Request, reply: Reply) -> None:
        self.stop(reason="stop", reply=reply)

    def stop(self, *, reason: str, reply: Reply | None = None) -> None:
        """Save (not while ``untrained``: nothing trained, nothing to save), then ask the loop
        to end (``stop_requested``)."""
        target = self.target
        saved: list[str | None] = [None]

        def done(result: CheckpointMeta | BaseException) -> None:
            saved[0] = None if isinstance(result, BaseException) else result.name

        untrained = target.untrained
        if not untrained:
            target.save(reason, wait=True, on_done=done)
        target.stop_requested = True
        target.set_paused(False)
        why = f"{reason}; nothing trained yet, nothing saved" if untrained else reason
        log.info("stopping at step %d (%s)", target.step, why)
        if reply is not None:
            reply({"step": target.step, "checkpoint": saved[0]})
