"""Starting a Guard's run: which checkpoint it resumes from (or none), the refusal to start
afresh over checkpoints or the move of the previous run aside (``overwrite``), and, on rank 0,
the run directory, the control server, the sinks, the checkpoint store and ``agent.json``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from lossguard.agent.checkpoint.store import CheckpointStore
from lossguard.agent.config import Config
from lossguard.agent.control.serve import serve_control
from lossguard.agent.distributed import broadcast_objects
from lossguard.agent.recovery import DETECTOR_STATE, Stateful
from lossguard.agent.telemetry.collector import Telemetry
from lossguard.agent.telemetry.hardware import device_description
from lossguard.agent.telemetry.progress import make_progress
from lossguard.agent.telemetry.sinks import DisplaySink, MetricsLogSink, Sink, WandbSink
from lossguard.common.control.protocol import Target, parse_target
from lossguard.common.control.server import (
    ControlServer,
    RefusedHook,
    RejectHook,
    answered_before,
    socket_is_live,
)
from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.directory import RunDirectory, package_versions, set_aside
from lossguard.common.rundir.names import CHECKPOINT_DIR, CONFIG_FILE, SOCKET_NAME
from lossguard.common.rundir.supervisor_file import RESUME_ENV

log = logging.getLogger("lossguard.agent")
T = TypeVar("T")

RESUME_ARGUMENT = "argument"
"""A resume's ``source`` when it came from the caller (``resume=``, ``--resume``)."""


def resume_target(resume: Target | str | None) -> tuple[Target | None, str | None]:
    """The checkpoint to resume from and where that came from: ``$LOSSGUARD_RESUME`` when set
    and not empty (a supervisor's restart, which knows the good checkpoint), else ``resume``
    (``RESUME_ARGUMENT``); (None, None) to start afresh. ValueError names a bad one."""
    from_env = os.environ.get(RESUME_ENV, "")
    value, source = (from_env, RESUME_ENV) if from_env else (resume, RESUME_ARGUMENT)
    if value is None:
        return None, None
    try:
        return parse_target(value), source
    except ValueError as exc:
        name = RESUME_ENV if source == RESUME_ENV else "resume"
        raise ValueError(f"{name}: {exc}") from None


class CheckpointsExist(FileExistsError):
    """A run directory that already has checkpoints, and neither a resume nor an overwrite."""

    def __init__(self, run_dir: Path, newest: str) -> None:
        super().__init__(
            f"{run_dir} already has checkpoints (newest: {newest}): pass resume='latest' "
            "(or a checkpoint name) to continue the run, or overwrite=True to start over"
        )
        self.run_dir = run_dir
        self.newest = newest

    def __reduce__(self) -> tuple[Any, ...]:  # broadcast to every rank under torchrun
        return type(self), (self.run_dir, self.newest)


@dataclass(frozen=True)
class StartPlan:
    """How a Guard starts: from the checkpoint ``target`` (None: afresh), where that came
    from (``source``), the batches to pass over after it, and whether to overwrite."""

    target: Target | None
    source: str | None
    skip_batches: int
    overwrite: bool

    @classmethod
    def of(cls, resume: Target | str | None, skip_batches: int, overwrite: bool) -> StartPlan:
        """The plan for Guard's ``resume``, ``skip_batches`` and ``overwrite`` arguments and
        ``$LOSSGUARD_RESUME``; ValueError names a bad one."""
        target, source = resume_target(resume)
        if source == RESUME_ENV:
            skip_batches, overwrite = 0, False  # the supervisor's restart: its checkpoint as is
        if target is not None and overwrite:
            raise ValueError("resume and overwrite=True exclude each other")
        if skip_batches < 0 or (skip_batches and target is None):
            raise ValueError(
                f"skip_batches: must be >= 0, and only with resume, not {skip_batches}"
            )
        return cls(target, source, skip_batches, overwrite)

    def audit(self) -> dict[str, Any]:
        """The ``resumed`` event's fields beside what was restored."""
        return {
            "target": self.target,
            "source": str(self.source),
            "skipped_batches": self.skip_batches,
        }

    def log_resumed(self, restored: dict[str, Any]) -> None:
        log.info(
            "resumed from %s at step %d (target %s from %s)",
            restored["checkpoint"],
            restored["step"],
            self.target,
            "$" + RESUME_ENV if self.source == RESUME_ENV else "the resume argument",
        )


def on_main(work: Callable[[], T], rank: int, group: Any) -> T:
    """Run ``work`` on rank 0; every rank returns its result or raises its exception."""
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            outcome = [(work(), None)]
        except Exception as exc:
            outcome = [(None, exc)]
    result, error = broadcast_objects(outcome, group)[0]
    if error is not None:
        raise error
    return result


def start_over_check(path: Path, start: StartPlan) -> tuple[Path, list[str]] | None:
    """Before anything is written: refuse to start afresh over checkpoints, or move the
    previous run aside (``overwrite``); returns where to and which checkpoints."""
    existing = list_checkpoints(path / CHECKPOINT_DIR)
    if start.target is not None or not existing:
        return None
    if not start.overwrite:
        raise CheckpointsExist(path, existing[-1].name)
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
    on_reject: RejectHook,
    on_refused: RefusedHook,
    progress: tuple[int | None, int] | None,
) -> OpenedRun:
    """Rank 0, in the run directory just opened: the control server, the sinks, the records
    and ``agent.json``. ``progress``: (max_steps, step) for the progress display; None: no
    display."""
    path = run_dir.path
    continuing = (path / CONFIG_FILE).exists()
    # these fail before any file is written
    control = serve_control(
        config.control,
        path,
        on_reject,
        answered=answered_before(run_dir.read_events()),
        on_refused=on_refused,
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
