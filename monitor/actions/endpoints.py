"""Where a run's agent takes commands, first found first: the TCP address ``actions.agents``
gives (an override); its control socket under the runs root when it runs on this host; the
TCP address the run announces (``lossguard_agent_info``,
:mod:`lossguard.monitor.sources.announced`); its control socket under the runs root. And where
its supervisor takes ``restart``: the TCP address the run announces, else ``supervisor.sock``
in its run directory. Every TCP endpoint takes the token from the environment."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from lossguard.common.control.address import join_address, split_address
from lossguard.common.control.client import ControlClient
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.supervisor_file import SupervisorInfo
from lossguard.monitor.actions.policy import ActionsConfig
from lossguard.monitor.sources.announced import AnnouncedRuns
from lossguard.monitor.sources.discovery import DiscoveredTarget, discover_agents, distrusted


class NoEndpoint(Exception):
    """No way to reach the run's agent is known (one line)."""


class NoSupervisor(NoEndpoint):
    """The run is known and runs without a supervisor: a restart cannot happen (not retried)."""


class Endpoints:
    """Opens a control client for a run."""

    def __init__(
        self,
        config: ActionsConfig,
        runs_root: Path | None,
        timeout_s: float,
        announced: AnnouncedRuns | None = None,
    ) -> None:
        self.config = config
        self.runs_root = runs_root
        self.timeout_s = timeout_s
        self.announced = announced

    def client(self, run_id: str) -> ControlClient:
        address = self._agent_address(run_id)
        if address is not None:
            return self._tcp(run_id, address)
        return ControlClient(socket_path=self.socket_of(run_id), timeout=self.timeout_s)

    def _runs_here(self, run_id: str) -> bool:
        """Whether rank 0 of ``run_id`` announces this host under the runs root (its socket
        can be dialled here)."""
        try:
            return self._rank0(run_id).host == socket.gethostname()
        except NoEndpoint:
            return False

    def supervisor_client(self, run_id: str) -> ControlClient:
        """The run's supervisor: the TCP address it announces, else its ``supervisor.json``
        and socket in the run directory."""
        announced = self.announced.get(run_id) if self.announced else None
        if announced is not None and announced.supervisor is not None:
            return self._tcp(run_id, announced.supervisor)
        run_dir = self.run_dir(run_id)
        if run_dir is None and announced is not None:
            raise NoSupervisor(
                f"run {run_id} announces no supervisor (run it under lossguard-supervise "
                "--control-tcp)"
            )
        if run_dir is None:
            raise NoEndpoint(f"run {run_id}: no run directory under the runs root, no supervisor")
        paths = RunPaths.of(run_dir)
        if not paths.supervisor.exists():
            raise NoSupervisor(f"run {run_id} has no supervisor (run it under lossguard-supervise)")
        why = distrusted(paths.supervisor)
        info = SupervisorInfo.read(run_dir) if why is None else None
        if info is None or info.socket is None:
            raise NoEndpoint(
                f"run {run_id}: its supervisor.json is not believed: {why}"
                if why is not None
                else f"run {run_id}: its supervisor.json names no socket"
            )
        # the run directory's own socket, whatever the file names
        return ControlClient(socket_path=paths.supervisor_socket, timeout=self.timeout_s)

    def knows(self, run_id: str) -> bool:
        """Whether some endpoint of ``run_id`` is known."""
        return self._agent_address(run_id) is not None or self.run_dir(run_id) is not None

    def ctl_target(self, run_id: str) -> list[str] | None:
        """How ``lossguard-ctl`` reaches the run (None: not known here)."""
        address = self._agent_address(run_id)
        if address is not None:
            return ["--tcp", join_address(*address), "--token-env", self.config.token_env]
        try:
            return ["--run-dir", str(self._rank0(run_id).run_dir)]
        except NoEndpoint:
            return None

    def _agent_address(self, run_id: str) -> tuple[str, int] | None:
        """The run's agent over TCP: the configured override, else its announcement, unless
        it runs on this host under the runs root (None: through its socket)."""
        configured = self.config.agents.get(run_id)
        if configured is not None:
            return split_address(configured)
        if self._runs_here(run_id):
            return None
        announced = self.announced.get(run_id) if self.announced else None
        return announced.control if announced is not None else None

    def _tcp(self, run_id: str, address: tuple[str, int]) -> ControlClient:
        token = os.environ.get(self.config.token_env)
        if not token:
            raise NoEndpoint(
                f"run {run_id} is reached over TCP but ${self.config.token_env} is not set"
            )
        return ControlClient(tcp=address, token=token, timeout=self.timeout_s)

    def run_dir(self, run_id: str) -> Path | None:
        """The run's directory under the runs root (None: not known here)."""
        try:
            return self._rank0(run_id).run_dir
        except NoEndpoint:
            return None

    def socket_of(self, run_id: str) -> Path:
        """Rank 0's control socket of ``run_id`` under the runs root."""
        socket_path = self._rank0(run_id).socket_path
        if socket_path is None:
            raise NoEndpoint(f"run {run_id}: its agent.json names no control socket")
        return socket_path

    def _rank0(self, run_id: str) -> DiscoveredTarget:
        if self.runs_root is None:
            raise NoEndpoint(
                f"run {run_id}: no control endpoint (set scrape.runs_root, or actions.agents "
                "for an agent on another host)"
            )
        for target in discover_agents(self.runs_root):
            if target.run_id == run_id and target.rank == 0:
                return target
        raise NoEndpoint(f"run {run_id}: no agent.json under {self.runs_root}")
