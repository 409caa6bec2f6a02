"""The agent's typed config (torch-free): YAML in, validated pydantic model out.

``GuardConfig`` (``guard.py``, ``telemetry.py``) is what a Guard reads in your own loop;
``TrainerConfig`` (``trainer.py``; also named ``Config``) is the built-in trainer's, a GuardConfig
with the trainer's sections, read from one YAML file (``loading.py``). Validation reads neither
the environment nor the disk; ``host.py`` holds the checks made at start instead."""

from lossguard.agent.config.guard import (
    CheckpointConfig,
    ControlConfig,
    GuardConfig,
    LogConfig,
    MitigationConfig,
    PrecisionConfig,
    RunConfig,
    SnapshotConfig,
    TimeoutsConfig,
    WandbConfig,
)
from lossguard.agent.config.host import check_data_files, check_host, control_token
from lossguard.agent.config.loading import load_config, parse_config
from lossguard.agent.config.telemetry import (
    Fp8FidelityConfig,
    Fp8HealthConfig,
    GradDiagnosticsConfig,
    SpikeConfig,
    TelemetryConfig,
)
from lossguard.agent.config.trainer import (
    Config,
    DataConfig,
    DistributedConfig,
    EarlyStoppingConfig,
    FaultConfig,
    FaultKind,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    TrainerConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ControlConfig",
    "DataConfig",
    "DistributedConfig",
    "EarlyStoppingConfig",
    "FaultConfig",
    "FaultKind",
    "Fp8FidelityConfig",
    "Fp8HealthConfig",
    "GradDiagnosticsConfig",
    "GuardConfig",
    "LogConfig",
    "MitigationConfig",
    "ModelConfig",
    "OptimConfig",
    "PrecisionConfig",
    "RunConfig",
    "SnapshotConfig",
    "SpikeConfig",
    "TelemetryConfig",
    "TimeoutsConfig",
    "TrainConfig",
    "TrainerConfig",
    "WandbConfig",
    "check_data_files",
    "check_host",
    "control_token",
    "load_config",
    "parse_config",
]
