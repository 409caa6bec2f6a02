"""RunPaths: where each file of one run directory lives (docs/design.md "Run directory").

Every module that opens a run's file asks a ``RunPaths`` for it instead of joining names itself;
the names are in ``names``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lossguard.common.rundir.names import (
    AGENT_FILE,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    COORDINATION_DIR,
    ENV_FILE,
    EVENTS_LOG,
    METRICS_LOG,
    SOCKET_NAME,
    SUPERVISOR_FILE,
    SUPERVISOR_SOCKET,
)


@dataclass(frozen=True)
class RunPaths:
    """The files of the run directory ``root``."""

    root: Path

    @classmethod
    def of(cls, root: str | Path) -> RunPaths:
        return cls(Path(root))

    @property
    def config(self) -> Path:
        """The resolved config (``config.yaml``)."""
        return self.root / CONFIG_FILE

    @property
    def env(self) -> Path:
        """Versions, host, device and argv (``env.json``)."""
        return self.root / ENV_FILE

    @property
    def metrics(self) -> Path:
        """The metrics log (``metrics.jsonl``)."""
        return self.root / METRICS_LOG

    @property
    def events(self) -> Path:
        """The audit trail (``events.jsonl``)."""
        return self.root / EVENTS_LOG

    @property
    def agent(self) -> Path:
        """How a monitor finds the run (``agent.json``)."""
        return self.root / AGENT_FILE

    @property
    def socket(self) -> Path:
        """The agent's control socket (``control.sock``)."""
        return self.root / SOCKET_NAME

    @property
    def supervisor(self) -> Path:
        """The supervisor's record (``supervisor.json``)."""
        return self.root / SUPERVISOR_FILE

    @property
    def supervisor_socket(self) -> Path:
        """The supervisor's control socket (``supervisor.sock``)."""
        return self.root / SUPERVISOR_SOCKET

    @property
    def checkpoints(self) -> Path:
        """The folder of saved checkpoints (``checkpoints/``)."""
        return self.root / CHECKPOINT_DIR

    @property
    def coordination(self) -> Path:
        """Where the supervisors of a multi-node run agree (``supervisors/``)."""
        return self.root / COORDINATION_DIR
