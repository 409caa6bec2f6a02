"""What a training command's exit stands for in the exit-code contract
(``lossguard.common.exitcodes``), and how the nodes' outcomes combine into the run's."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from lossguard.common.exitcodes import ENDS_THE_RUN, EXIT_CODES, EXIT_PREEMPTED, EXIT_STOPPED
from lossguard.common.rundir.agent_file import AgentInfo
from lossguard.common.rundir.paths import RunPaths

# of several nodes' run-ending codes, the first in this order is the run's
PRECEDENCE = (
    EXIT_CODES["config"],
    EXIT_CODES["preempted"],
    EXIT_CODES["stopped"],
    EXIT_CODES["completed"],
)


def child_outcome(status: int, run_dir: Path, started_at: float) -> int | None:
    """The contract code the training command's exit ``status`` stands for; None: a crash.

    A code of the contract stands for itself. Any other status is a crash unless the agent
    recorded, after this start, that the run stopped or was preempted: torchrun exits 1 when
    its workers exit with any code but 0, so the agent's ``agent.json`` says what happened."""
    if status in ENDS_THE_RUN:
        return status
    try:
        agent = AgentInfo.parse(RunPaths.of(run_dir).agent.read_bytes())
    except (OSError, ValueError):
        return None
    fresh = agent.finished_at is not None and agent.finished_at >= started_at
    if not fresh:
        return None
    return {"stopped": EXIT_STOPPED, "preempted": EXIT_PREEMPTED}.get(agent.exit or "")


def combined(codes: Iterable[int | None]) -> int | None:
    """The run's code from its nodes' (None: some node crashed)."""
    found = list(codes)
    if any(code is None for code in found):
        return None
    return next(code for code in PRECEDENCE if code in found)
