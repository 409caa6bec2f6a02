"""Multi-node supervision: one ``lossguard-supervise`` per node over a shared run directory.

Node 0 leads: it alone decides (when every node's group starts, from which checkpoint, when all
end, and the exit code) and keeps the run-wide restart budget and crash-loop detection. It
publishes each decision in ``supervisors/decision.json`` (written atomically, rewritten every
``HEARTBEAT_S`` with a new ``beat`` so the others see it lives). Every other node follows: it
reports its group in ``supervisors/node-<i>.json`` and acts on the leader's decisions only:
never two nodes choosing differently.

A decision names its leader (a fresh id per leader process), so a follower never acts on a
decision a previous leader left behind: it joins once it has seen the leader's ``beat`` change,
and the leader starts a generation once every node has joined it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lossguard.common.rundir.files import write_atomically
from lossguard.common.rundir.paths import RunPaths

DECISION_FILE = "decision.json"
HEARTBEAT_S = 2.0

Action = Literal["join", "run", "end", "exit"]
"""join: nodes, announce yourselves; run: start generation N's group; end: end generation N's
group now (a node's group crashed, or a restart was requested); exit: exit with ``exit_code``."""


@dataclass(frozen=True)
class Decision:
    leader: str
    beat: int
    generation: int
    action: Action
    resume_from: str | None = None
    exit_code: int | None = None
    control_tcp: str | None = None  # node 0's advertised TCP control, for every node's command


@dataclass(frozen=True)
class NodeReport:
    """A follower's view of its own group in one generation."""

    node: int
    leader: str  # the leader it joined
    hostname: str
    pid: int
    generation: int  # 0: joined, nothing started yet
    resume_from: str | None = None  # the checkpoint its group of this generation started from
    child_pid: int | None = None
    status: int | None = None  # the group's exit status; None while it runs
    code: int | None = None  # the exit code of the contract it stands for; None: a crash
    ended_at: float | None = None  # when it saw the group end (Unix seconds)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Coordination:
    """The files through which the nodes of one run agree."""

    def __init__(self, run_dir: Path) -> None:
        self.path = RunPaths.of(run_dir).coordination
        self.path.mkdir(parents=True, exist_ok=True)

    def write_decision(self, decision: Decision) -> None:
        write_atomically(self.path / DECISION_FILE, json.dumps(dataclasses.asdict(decision)))

    def decision(self) -> Decision | None:
        data = _read(self.path / DECISION_FILE)
        try:
            return Decision(**data) if data is not None else None
        except TypeError:
            return None

    def report(self, report: NodeReport) -> None:
        path = self.path / f"node-{report.node}.json"
        write_atomically(path, json.dumps(dataclasses.asdict(report)))

    def reports(self, leader: str, nnodes: int) -> dict[int, NodeReport]:
        """The followers' reports that joined ``leader`` (node 0 is the leader itself)."""
        found = {}
        for node in range(1, nnodes):
            data = _read(self.path / f"node-{node}.json")
            try:
                report = NodeReport(**data) if data is not None else None
            except TypeError:
                continue
            if report is not None and report.leader == leader:
                found[node] = report
        return found

    def own_report(self, node: int) -> NodeReport | None:
        data = _read(self.path / f"node-{node}.json")
        try:
            return NodeReport(**data) if data is not None else None
        except TypeError:
            return None


# ------------------------------------------------------------------ where a node stands


def _torchrun_option(command: Sequence[str], name: str) -> str | None:
    """The value of a torchrun option (``--nnodes 2``, ``--nnodes=2``, ``--node_rank``) in
    the command, when the command is torchrun (``torchrun`` or ``-m torch.distributed.run``)."""
    names = {f"--{name}", f"--{name.replace('_', '-')}", f"--{name.replace('-', '_')}"}
    for i, word in enumerate(command):
        key, sep, value = word.partition("=")
        if key in names:
            return value if sep else (command[i + 1] if i + 1 < len(command) else None)
    return None


def is_torchrun(command: Sequence[str]) -> bool:
    words = [Path(w).name for w in command[:3]]
    return "torchrun" in words or "torch.distributed.run" in command[:3]


@dataclass(frozen=True)
class Placement:
    node: int
    nnodes: int


class PlacementError(ValueError):
    """The node rank or node count cannot be worked out or disagree (one line)."""


def _count(text: str, what: str) -> int:
    if not re.fullmatch(r"\d+", text):
        raise PlacementError(f"{what}: expected a whole number, not {text!r}")
    return int(text)


def placement(
    command: Sequence[str],
    node: int | None,
    nnodes: int | None,
    env: Mapping[str, str] = os.environ,
) -> Placement:
    """This node's rank and the node count: the options first, then Slurm's ``SLURM_NODEID``
    and ``SLURM_JOB_NUM_NODES``, then torchrun's ``--node-rank`` and ``--nnodes`` (a range
    ``MIN:MAX`` is refused: the supervisor needs a fixed node count); one node by default."""
    torchrun = is_torchrun(command)
    if node is None:
        text = env.get("SLURM_NODEID") or (
            _torchrun_option(command, "node_rank") if torchrun else None
        )
        node = _count(text, "node rank") if text else 0
    if nnodes is None:
        text = (_torchrun_option(command, "nnodes") if torchrun else None) or env.get(
            "SLURM_JOB_NUM_NODES"
        )
        if text is not None and ":" in text:
            low, _, high = text.partition(":")
            if low != high:
                raise PlacementError(
                    f"torchrun --nnodes {text}: elastic node counts are not supervised; "
                    "give a fixed count"
                )
            text = low
        nnodes = _count(text, "node count") if text else 1
    if torchrun:
        restarts = _torchrun_option(command, "max_restarts")
        if restarts not in (None, "0"):
            raise PlacementError(
                f"torchrun --max-restarts {restarts}: under lossguard-supervise torchrun must "
                "not restart on its own (--max-restarts 0, its default); the supervisors "
                "restart every node's group from one checkpoint"
            )
    if not 0 <= node < nnodes:
        raise PlacementError(f"node rank {node} is not below the node count {nnodes}")
    return Placement(node, nnodes)
