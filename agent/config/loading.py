"""Reading the built-in trainer's config: plain data or a YAML file, with ``--set`` overrides."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lossguard.agent.config.trainer import TrainerConfig
from lossguard.common.config import read_config_file, validate


def parse_config(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> TrainerConfig:
    """Validate plain data (plus overrides) into a TrainerConfig, or raise ConfigError."""
    return validate(TrainerConfig, json.loads(json.dumps(dict(data), default=str)), overrides)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainerConfig:
    """Read a YAML config file, apply ``--set`` overrides and validate."""
    return parse_config(read_config_file(path), overrides)
