"""How a run starts, decided before torch loads: the checkpoint it resumes from (or none,
``ResumePlan``) and the checks of its run directory that need no torch (``check_start``), so
that ``lossguard-agent run`` refuses a bad start in a fraction of a second."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lossguard.common.config import ConfigError
from lossguard.common.control.protocol import Target, parse_target
from lossguard.common.control.server import socket_is_live
from lossguard.common.rundir.checkpoints import CheckpointMeta, list_checkpoints
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.supervisor_file import RESUME_ENV

if TYPE_CHECKING:
    from lossguard.agent.config import Config

log = logging.getLogger("lossguard.agent")

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
class ResumePlan:
    """How a Guard starts: from the checkpoint ``target`` (None: afresh), where that came
    from (``source``), the batches to pass over after it, and whether to overwrite.

    A run directory without checkpoints is started in (a run that crashed before its first
    checkpoint starts again). One with checkpoints is refused (``CheckpointsExist``) unless
    ``resume`` or ``overwrite`` says what to do:

    - ``resume``: a target (``latest``, ``last_good``, ``best``, a step, a checkpoint name such
      as ``step_00000150``) restored, on every rank, before the first step; then
      ``skip_batches`` batches are passed over. ``$LOSSGUARD_RESUME``, set by the supervisor for
      a restart, wins over ``resume``, ``skip_batches`` and ``overwrite``. A ``resumed`` event
      records the target, where it came from and what was restored.
    - ``overwrite=True``: start over from step 0. The previous run's checkpoints, metrics and
      events, config and environment records are moved, not deleted, into
      ``run_dir/overwritten-<time>/`` (an ``overwritten`` event says where); refused while
      another agent serves the run directory's control socket.
    """

    target: Target | None
    source: str | None
    skip_batches: int
    overwrite: bool

    @classmethod
    def of(cls, resume: Target | str | None, skip_batches: int, overwrite: bool) -> ResumePlan:
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


def checkpoints_to_start_over(path: Path, start: ResumePlan) -> list[CheckpointMeta]:
    """The checkpoints in run directory ``path`` that ``start`` would start over (none when it
    resumes); ``CheckpointsExist`` when there are some and it does not overwrite."""
    if start.target is not None:
        return []
    existing = list_checkpoints(RunPaths.of(path).checkpoints)
    if existing and not start.overwrite:
        raise CheckpointsExist(path, existing[-1].name)
    return existing


def check_start(run_path: Path | None, start: ResumePlan, *, afresh: bool) -> None:
    """The checks of a start in run directory ``run_path`` (None: a new run id, a new
    directory) that need no torch: a resume needs the directory, not running; ``afresh``
    (also check what only rank 0 checks under torchrun): a start afresh over checkpoints is
    refused (``CheckpointsExist``) unless it overwrites. ConfigError names a problem."""
    if start.target is None:
        if run_path is not None and afresh:
            checkpoints_to_start_over(run_path, start)
        return
    if run_path is None:
        raise ConfigError("run.id: required to resume (the run directory is <run.dir>/<id>)")
    paths = RunPaths.of(run_path)
    if not paths.config.exists():
        raise ConfigError(f"run.id: no run directory {run_path} to resume")
    if socket_is_live(paths.socket):
        raise ConfigError(
            f"run.id: {run_path} is still running (its control socket answers); "
            "stop it before resuming"
        )


def command_plan(resume: Target | str | None, skip_batches: int, overwrite: bool) -> ResumePlan:
    """``ResumePlan.of`` for a command: ConfigError names a bad argument."""
    try:
        return ResumePlan.of(resume, skip_batches, overwrite)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run_path(config: Config) -> Path | None:
    """``<run.dir>/<run.id>``; None without an id (a new run gets a new one)."""
    return config.run.dir / config.run.id if config.run.id is not None else None
