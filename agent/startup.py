"""Starting a Guard's run: which checkpoint it resumes from (or none), the refusal to start
afresh over checkpoints or the move of the previous run aside (``overwrite``); on rank 0, the
run directory, the control server, the sinks, the checkpoint store and ``agent.json``; on
every rank, the recovery of the run's checkpoint format (``torch`` payloads, or
``dcp`` for a sharded model) with its in-memory snapshots."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from lossguard.agent.checkpoint.cadence import snapshot_store
from lossguard.agent.checkpoint.dcp_format import DcpCheckpoints, ShardedState
from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.config import Config
from lossguard.agent.control.serve import serve_control
from lossguard.agent.distributed import broadcast_objects
from lossguard.agent.dtensors import is_sharded
from lossguard.agent.recovery import DETECTOR_STATE, Events, Recovery, Stateful, TrainProgress
from lossguard.agent.start_plan import StartPlan, checkpoints_to_start_over
from lossguard.agent.telemetry.collector import Telemetry
from lossguard.agent.telemetry.hardware import device_description
from lossguard.agent.telemetry.progress import make_progress
from lossguard.agent.telemetry.sinks import DisplaySink, MetricsLogSink, Sink, WandbSink
from lossguard.common.control.address import advertised_address
from lossguard.common.control.protocol import ErrorCode
from lossguard.common.control.server import ControlServer, answered_before, socket_is_live
from lossguard.common.rundir.checkpoints import CheckpointMeta
from lossguard.common.rundir.directory import RunDirectory, package_versions, set_aside
from lossguard.common.rundir.events import COMMAND
from lossguard.common.rundir.names import CHECKPOINT_DIR, CONFIG_FILE, SOCKET_NAME

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


def start_over_check(path: Path, start: StartPlan) -> tuple[Path, list[str]] | None:
    """Before anything is written: refuse to start afresh over checkpoints, or move the
    previous run aside (``overwrite``); returns where to and which checkpoints."""
    existing = checkpoints_to_start_over(path, start)
    if not existing:
        return None
    if socket_is_live(path / SOCKET_NAME):
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


class OpenedRun(NamedTuple):
    """What rank 0 opened for a run in its run directory."""

    control: ControlServer | None
    checkpoints: CheckpointStore
    sinks: list[Sink]


def start_telemetry(
    config: Config,
    model: torch.nn.Module,
    *,
    rank: int,
    world_size: int,
    run_id: str,
    max_steps: int | None,
    flops_per_token: float | None,
    group: Any,
    loss_scaling: bool,
) -> Telemetry | None:
    """The run's telemetry (None: ``telemetry.enabled`` is off). ``flops_per_token``
    defaults to 6 x the trainable parameters."""
    if not config.telemetry.enabled:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return Telemetry(
        config,
        model=model,
        device=next(model.parameters()).device,
        rank=rank,
        world_size=world_size,
        run_id=run_id,
        max_steps=max_steps,
        flops_per_token=flops_per_token or 6.0 * sum(p.numel() for p in params),
        group=group,
        loss_scaling=loss_scaling,
    )


def detector_states(telemetry: Telemetry) -> dict[str, Stateful]:
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
    run_dir: RunDirectory,
    config: Config,
    *,
    run_id: str,
    device: torch.device,
    world_size: int,
    telemetry: Telemetry | None,
    event: Events,
    progress: tuple[int | None, int] | None,
) -> OpenedRun:
    """Rank 0, in the run directory just opened: the control server, the sinks, the records
    and ``agent.json``. ``event`` audits rejected commands; ``progress``:
    (max_steps, step) for the progress display; None: no display."""
    path = run_dir.path
    continuing = (path / CONFIG_FILE).exists()

    def rejected(request_id: str | None, code: ErrorCode, message: str) -> None:
        if request_id is not None:  # a command we could identify; garbage lines are not events
            event(COMMAND, id=request_id, ok=False, error={"code": code.value, "message": message})

    def refused(reason: str) -> None:
        """Refused before authentication: counted only (an unauthenticated peer must not grow
        the audit trail)."""
        if telemetry is not None:
            telemetry.control_refused(reason)

    # these fail before any file is written
    control = serve_control(
        config.control,
        path,
        rejected,
        answered=answered_before(run_dir.read_events()),
        on_refused=refused,
    )
    if telemetry is not None:
        tcp = control.tcp_address if control is not None else None
        telemetry.announce(
            None if tcp is None else advertised_address(tcp, config.control.advertise)
        )
    sinks: list[Sink] = [MetricsLogSink(run_dir.metrics)]
    if config.wandb.enabled:
        from lossguard.agent.telemetry.wandb_logger import WandbLogger

        wandb = WandbLogger(
            config.wandb,
            run_id=run_id,
            run_dir=path,
            config=config.resolved(),
            resume=continuing,
        )
        sinks.append(WandbSink(wandb))
    run_dir.write_config(config.resolved())
    run_dir.write_env(device_description(device), world_size)
    checkpoints = CheckpointStore(
        path / CHECKPOINT_DIR,
        keep_last=config.checkpoint.keep_last,
        config_hash=config.digest(),
        versions=package_versions(),
        dir_mode=run_dir.dir_mode,
    )
    run_dir.write_discovery(
        run_id=run_id,
        socket_path=control.socket_path if control else None,
        metrics_urls=telemetry.urls if telemetry else [],
        world_size=world_size,
    )
    if progress is not None:
        sinks.append(DisplaySink(make_progress(*progress)))
    return OpenedRun(control, checkpoints, sinks)


def start_recovery(
    config: Config,
    state: dict[str, Stateful],
    progress: TrainProgress,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: Path,
    store: CheckpointStore | None,
    group: Any,
    rank: int,
    world_size: int,
    device: torch.device,
    telemetry: Telemetry | None,
    healthy_now: Callable[[], bool],
    on_restored: Callable[[CheckpointMeta], None],
    event: Events,
) -> Recovery:
    """The recovery of every registered state in ``state`` (``model`` and ``optimizer``
    among them): ``dcp`` checkpoints for a sharded model (written by every rank), else
    ``torch`` ones; either with the in-memory snapshots that ``config.snapshot`` asks for."""
    sharded = (
        DcpCheckpoints(
            path / CHECKPOINT_DIR,
            ShardedState(model, optimizer),
            store=store,
            rank=rank,
            world_size=world_size,
            device=device,
            timeout_s=config.distributed.timeout_s,
        )
        if is_sharded(model)
        else None
    )
    return Recovery(
        state,
        progress,
        store=store,
        snapshots=snapshot_store(config.snapshot),
        group=group,
        rank=rank,
        world_size=world_size,
        async_save=config.checkpoint.async_save,
        telemetry=telemetry,
        healthy_now=healthy_now,
        on_restored=on_restored,
        event=event,
        sharded=sharded,
    )
