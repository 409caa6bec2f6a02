"""The agent's control server, as its ``control`` config section asks for it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from lossguard.agent.config import ControlConfig, control_token
from lossguard.common.config import ConfigError
from lossguard.common.control.server import (
    ControlServer,
    ListenError,
    PendingCommand,
    RefusedHook,
    RejectHook,
)
from lossguard.common.rundir.paths import RunPaths


def serve_control(
    config: ControlConfig,
    run_dir: Path,
    on_reject: RejectHook | None = None,
    answered: Iterable[PendingCommand] = (),
    on_refused: RefusedHook | None = None,
) -> ControlServer | None:
    """Start the control server that ``config`` asks for (None: neither socket nor TCP).
    A listener that cannot start is a ConfigError that names the key."""
    if not config.socket and config.tcp is None:
        return None
    tcp = None
    if config.tcp is not None:
        host, _, port = config.tcp.rpartition(":")
        tcp = (host, int(port))
    try:
        server = ControlServer(
            socket_path=RunPaths.of(run_dir).socket if config.socket else None,
            tcp=tcp,
            token=control_token(config) if tcp else None,
            on_reject=on_reject,
            on_refused=on_refused,
            answered=answered,
        )
    except ListenError as exc:
        raise ConfigError(f"control.{exc.endpoint}: {exc}") from None
    server.start()
    return server
