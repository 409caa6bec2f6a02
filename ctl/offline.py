"""What ``lossguard-ctl`` tells from a run directory when no agent answers: the checkpoints on
disk, and one line on a dead agent (its pid, how far it got, its supervisor or how to resume it).
Torch-free."""

from __future__ import annotations

import json
import shlex
import socket
from pathlib import Path
from typing import Any

import yaml

from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.checkpoints import list_checkpoints
from lossguard.common.rundir.metrics_log import last_logged
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.supervisor_file import RESTARTING, SupervisorInfo, pid_alive
from lossguard.common.rundir.targets import listing, ordered

BUILT_IN_TRAINER = ("lossguard-agent", "lossguard/agent/cli.py")
"""How ``env.json``'s ``argv[0]`` ends for a run of ``lossguard-agent run``."""


def checkpoints_on_disk(run_dir: Path) -> dict[str, Any]:
    """The ``checkpoints`` command's result, read from ``run_dir/checkpoints``."""
    return listing(list_checkpoints(RunPaths.of(run_dir).checkpoints))


def dead_agent(run_dir: Path) -> str | None:
    """One line on the run's agent if it is known dead (``agent.json`` names this host and a
    pid that no longer runs): its pid, last step, and whether its supervisor is restarting it
    or else how to resume it. None when it may live, or this host cannot tell."""
    paths = RunPaths.of(run_dir)
    try:
        info = AgentInfo.parse(paths.agent.read_bytes())
    except (OSError, ValueError):
        return None
    hostname = socket.gethostname()
    if info.pid is None or info.hostname != hostname or pid_alive(info.pid):
        return None
    metas = list_checkpoints(paths.checkpoints)
    step = last_logged(run_dir).step
    if step is None:
        step = next((m.step for m in ordered(metas, "latest")), None)
    ended = f"{info.exit}, " if info.exit else ""
    reached = "unknown" if step is None else step
    line = f"agent pid {info.pid} is not running ({ended}last step {reached})"
    supervisor = SupervisorInfo.read(run_dir)
    if supervisor is not None and supervisor.alive_here(hostname) is not False:
        if supervisor.state in RESTARTING:
            return f"{line}; the supervisor (pid {supervisor.pid}) is restarting it"
        if supervisor.state == "crash_loop":
            line += f"; the supervisor (pid {supervisor.pid}) stopped restarting it (crash loop)"
    good = ordered(metas, "last_good")
    if not good:
        return f"{line}; no healthy checkpoint to resume from"
    return f"{line}; resume with: {resume_command(run_dir, info.world_size, good[0].name)}"


def resume_command(run_dir: Path, world_size: int, checkpoint: str) -> str:
    """The command line that resumes the run from ``checkpoint``, as it was started (from
    ``env.json``): ``lossguard-agent run`` with the run's ``config.yaml``, or the user's own
    script with ``$LOSSGUARD_RESUME``; under ``torchrun`` with as many processes."""
    argv = _recorded_argv(run_dir)
    launcher = ["torchrun", "--nproc_per_node", str(world_size)] if world_size > 1 else []
    if argv and not argv[0].endswith(BUILT_IN_TRAINER):
        python = ["python"] if argv[0].endswith(".py") and not launcher else []
        words = [*launcher, *python, *argv]
        return f"LOSSGUARD_RESUME={checkpoint} {shlex.join(words)}"
    agent = [*launcher, "-m", "lossguard.agent.cli"] if launcher else ["lossguard-agent"]
    config = RunPaths.of(run_dir).config
    words = [*agent, "run", str(config), "--resume", checkpoint]
    if _run_dir_in(config) != run_dir.resolve():  # its run.dir is relative to another folder
        words += ["--set", f"run.dir={run_dir.parent}"]
    return shlex.join(words)


def _recorded_argv(run_dir: Path) -> list[str]:
    try:
        argv = json.loads(RunPaths.of(run_dir).env.read_text(encoding="utf-8"))["argv"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [str(word) for word in argv] if isinstance(argv, list) else []


def _run_dir_in(config: Path) -> Path | None:
    """The run directory that ``config`` (a resolved ``config.yaml``) names, from here."""
    try:
        run = yaml.safe_load(config.read_text(encoding="utf-8"))["run"]
        return (Path(run["dir"]) / str(run["id"])).resolve()
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
