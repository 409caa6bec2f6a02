"""Opening a Guard's run: the refusal to start afresh over checkpoints or the move of the previous
run aside (``overwrite``, as the ``resume_plan`` says); on every rank, the telemetry hub; on
rank 0, the run directory's records (``RunRecords``: the control server, the sinks, the
checkpoint store and ``agent.json``); on every rank, the recovery in the run's checkpoint format
(``torch`` payloads, or ``dcp`` for a sharded model) with its in-memory snapshots."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from lossguard.agent.checkpoint.cadence import snapshot_store
from lossguard.agent.checkpoint.dcp_format import DcpCheckpoints, ShardedState
from lossguard.agent.checkpoint.formats import CheckpointFormat, Stateful
from lossguard.agent.checkpoint.sharded_format import DcpFormat
from lossguard.agent.checkpoint.snapshots import SnapshotStore
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.checkpoint.torch_format import TorchFormat
from lossguard.agent.config import GuardConfig
from lossguard.agent.control.serve import serve_control
from lossguard.agent.distributed import broadcast_objects
from lossguard.agent.dtensors import is_sharded
from lossguard.agent.recovery import DETECTOR_STATE, Recovery, TrainProgress
from lossguard.agent.restored import Restores
from lossguard.agent.resume_plan import ResumePlan, checkpoints_to_start_over
from lossguard.agent.run_context import RunContext
from lossguard.agent.run_records import RunRecords
from lossguard.agent.telemetry.hardware import device_description
from lossguard.agent.telemetry.hub import Telemetry
from lossguard.agent.telemetry.no_telemetry import NO_TELEMETRY, NoTelemetry
from lossguard.agent.telemetry.progress import make_progress
from lossguard.agent.telemetry.sinks import DisplaySink, MetricsLogSink, Sink, WandbSink
from lossguard.common.control.address import advertised_address
from lossguard.common.control.protocol import ErrorCode
from lossguard.common.control.server import ControlServer, answered_before, socket_is_live
from lossguard.common.rundir.directory import RunDirectory, package_versions, set_aside
from lossguard.common.rundir.events import COMMAND
from lossguard.common.rundir.paths import RunPaths

log = logging.getLogger("lossguard.agent")
T = TypeVar("T")


def on_main(work: Callable[[], T], rank: int, group: Any) -> T:
    """Run ``work`` on rank 0; every rank returns its result or raises its exception."""
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            outcome = [(work(), None)]
        except Exception as exc:
            outcome = [(None, exc)]
    result, error = broadcast_objects(outcome, group, "broadcast_object_list: start checks")[0]
    if error is not None:
        raise error
    return result


def start_over_check(path: Path, start: ResumePlan) -> tuple[Path, list[str]] | None:
    """Before anything is written: refuse to start afresh over checkpoints, or move the
    previous run aside (``overwrite``); returns where to and which checkpoints."""
    existing = checkpoints_to_start_over(path, start)
    if not existing:
        return None
    if socket_is_live(RunPaths.of(path).socket):
        raise FileExistsError(
            f"{path} is still running (its control socket answers): not overwriting it"
        )
    aside = set_aside(path)
    assert aside is not None  # there were checkpoints to move
    names = [meta.name for meta in existing]
    log.warning(
        "overwrite: moved the previous run in %s (%d checkpoints, newest %s) to %s",
        path,
        len(names),
        names[-1],
        aside,
    )
    return aside, names


def start_telemetry(
    config: GuardConfig,
    model: torch.nn.Module,
    ctx: RunContext,
    *,
    max_steps: int | None,
    flops_per_token: float | None,
    loss_scaling: bool,
) -> Telemetry | NoTelemetry:
    """The run's telemetry hub (``NO_TELEMETRY``: ``telemetry.enabled`` is off).
    ``flops_per_token`` defaults to 6 x the trainable parameters."""
    if not config.telemetry.enabled:
        return NO_TELEMETRY
    params = [p for p in model.parameters() if p.requires_grad]
    return Telemetry(
        config,
        model=model,
        device=ctx.device,
        rank=ctx.rank,
        world_size=ctx.world_size,
        run_id=ctx.run_id,
        max_steps=max_steps,
        flops_per_token=flops_per_token or 6.0 * sum(p.numel() for p in params),
        group=ctx.group,
        loss_scaling=loss_scaling,
    )


def detector_states(telemetry: Telemetry | NoTelemetry) -> dict[str, Stateful]:
    """The spike detectors, as the registered states that checkpoints carry."""
    return {f"{DETECTOR_STATE}{name}": d for name, d in telemetry.detectors.items()}


def start_fields(control: ControlServer | None, world_size: int) -> dict[str, Any]:
    """The ``start`` event's fields."""
    return {
        "pid": os.getpid(),
        "world_size": world_size,
        "control_socket": str(control.socket_path) if control else None,
        "control_tcp": control.tcp_address if control else None,
    }


def open_run(
    ctx: RunContext,
    run_dir: RunDirectory,
    config: GuardConfig,
    *,
    progress: tuple[int | None, int] | None,
) -> RunRecords:
    """Rank 0, in the run directory just opened: the control server, the sinks, the records
    and ``agent.json``. ``ctx.event`` audits rejected commands; ``progress``:
    (max_steps, step) for the progress display; None: no display."""
    paths = run_dir.paths
    continuing = paths.config.exists()
    telemetry = ctx.telemetry

    def rejected(request_id: str | None, code: ErrorCode, message: str) -> None:
        if request_id is not None:  # a command we could identify; garbage lines are not events
            error = {"code": code.value, "message": message}
            ctx.event(COMMAND, id=request_id, ok=False, error=error)

    # these fail before any file is written; a refusal before authentication is counted
    # only (an unauthenticated peer must not grow the audit trail)
    control = serve_control(
        config.control,
        run_dir.path,
        rejected,
        answered=answered_before(run_dir.read_events()),
        on_refused=telemetry.control_refused,
    )
    tcp = control.tcp_address if control is not None else None
    telemetry.announce(None if tcp is None else advertised_address(tcp, config.control.advertise))
    sinks: list[Sink] = [MetricsLogSink(run_dir.metrics)]
    if config.wandb.enabled:
        from lossguard.agent.telemetry.wandb_logger import WandbLogger

        wandb = WandbLogger(
            config.wandb,
            run_id=ctx.run_id,
            run_dir=run_dir.path,
            config=config.resolved(),
            resume=continuing,
        )
        sinks.append(WandbSink(wandb))
    run_dir.write_config(config.resolved())
    run_dir.write_env(device_description(ctx.device), ctx.world_size)
    checkpoints = CheckpointStore(
        paths.checkpoints,
        keep_last=config.checkpoint.keep_last,
        config_hash=config.digest(),
        versions=package_versions(),
        dir_mode=run_dir.dir_mode,
    )
    run_dir.write_discovery(
        run_id=ctx.run_id,
        socket_path=control.socket_path if control else None,
        metrics_urls=telemetry.urls,
        world_size=ctx.world_size,
    )
    if progress is not None:
        sinks.append(DisplaySink(make_progress(*progress)))
    return RunRecords(run_dir, control=control, checkpoints=checkpoints, sinks=sinks)


def checkpoint_format(
    ctx: RunContext,
    config: GuardConfig,
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    store: CheckpointStore | None,
    snapshots: SnapshotStore | None,
) -> CheckpointFormat:
    """The run's checkpoint format: ``dcp`` for a sharded model (written by every rank),
    else ``torch``."""
    if not is_sharded(model):
        return TorchFormat(ctx, store=store, snapshots=snapshots)
    files = DcpCheckpoints(
        ctx,
        RunPaths.of(path).checkpoints,
        ShardedState(model, optimizer),
        store=store,
        timeout_s=config.distributed.timeout.seconds,
    )
    return DcpFormat(ctx, files, store=store, snapshots=snapshots)


def start_recovery(
    ctx: RunContext,
    config: GuardConfig,
    state: dict[str, Stateful],
    progress: TrainProgress,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: Path,
    records: RunRecords,
    healthy_now: Callable[[], bool],
    restores: Restores,
) -> Recovery:
    """The recovery of every registered state in ``state`` (its ``model`` and ``optimizer``
    among them) in the run's ``checkpoint_format``, with the in-memory snapshots that
    ``config.snapshot`` asks for; ``restores`` hears of every restore."""
    snapshots = snapshot_store(config.snapshot)
    store = records.checkpoints
    checkpoints = checkpoint_format(
        ctx, config, path, model=model, optimizer=optimizer, store=store, snapshots=snapshots
    )
    return Recovery(
        ctx,
        state,
        progress,
        format=checkpoints,
        store=store,
        snapshots=snapshots,
        async_save=config.checkpoint.async_save,
        healthy_now=healthy_now,
        restores=restores,
    )
