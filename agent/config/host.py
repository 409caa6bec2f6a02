"""The checks that read this host's environment or disk, made when a run starts rather than when
a config is validated (a config stays valid read anywhere, e.g. a run's ``config.yaml``): the
control token and the built-in trainer's data files. Each is a ConfigError naming the key."""

from __future__ import annotations

from lossguard.agent.config.guard import ControlConfig
from lossguard.agent.config.trainer import DataConfig, TrainerConfig
from lossguard.common.config import ConfigError
from lossguard.common.control.bearer import token_from_env


def control_token(control: ControlConfig) -> str:
    """The TCP bearer token from ``$control.token_env`` (``control.tcp`` needs it)."""
    try:
        return token_from_env(control.token_env)
    except ValueError as exc:
        raise ConfigError(f"control.tcp: {exc}") from None


def check_data_files(data: DataConfig) -> None:
    """``data.path`` holds what ``data.kind`` reads."""
    if data.path is None:
        return
    if data.kind == "tokens":
        for split in ("train.bin", "val.bin"):
            if not (data.path / split).is_file():
                raise ConfigError(f"data.path: no such file: {data.path / split}")
    elif data.kind == "text" and not data.path.exists():
        raise ConfigError(f"data.path: no such file or directory: {data.path}")


def check_host(config: TrainerConfig) -> None:
    """Before a run of the built-in trainer starts: its data files and its control token."""
    check_data_files(config.data)
    if config.control.tcp is not None:
        control_token(config.control)
