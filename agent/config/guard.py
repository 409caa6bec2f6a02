"""A Guard's config (torch-free): the sections ``lossguard.agent.Guard`` reads in your own
training loop. The built-in trainer's config adds its own (``trainer.py``); the plumbing (sections,
one-line errors, overrides, YAML, durations) is ``lossguard.common.config``. Nothing here reads
the environment or the disk: that is left to start-up (``host.py``)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from lossguard.agent.config.telemetry import TelemetryConfig
from lossguard.common.config import Duration, Section, field_error
from lossguard.common.control.bearer import DEFAULT_TOKEN_ENV
from lossguard.common.sizes import MemoryBudget

MIN_TIMEOUT_S = 10.0
"""``distributed.timeout``'s floor: below it a slow step or save would end healthy ranks."""
MIN_STOP_GRACE_S = 5.0
"""``distributed.stop_grace``'s floor, for the same reason."""
DEFAULT_CHECKPOINT_SECONDS = 1800.0
"""The crash path's cadence when ``checkpoint.every`` is not set: a save every 30 minutes."""


class RunConfig(Section):
    id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        max_length=128,
        description="Run name; the run directory is <dir>/<id>. Default: <timestamp>.",
    )
    dir: Path = Field(default=Path("runs"), description="Root folder that holds run directories.")
    mode: str = Field(
        default="0700",
        description="The run directory's mode, an octal string: 0700 (private, the default), "
        "or 0750 to let the directory's group read the run (docs/security.md); never "
        "writable by group or others. Records written in it get the same bits, less execute.",
    )
    seed: int = Field(default=1337, ge=0, description="Seed of model init, sampling and dropout.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto = cuda when available, else cpu."
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            value = f"0{value:o}"  # YAML 1.1 reads an unquoted 0750 as an octal number
        text = str(value)
        if not re.fullmatch(r"0?[0-7]{3}", text):
            raise ValueError("must be an octal mode such as '0700' or '0750' (quote it)")
        bits = int(text, 8)
        if bits & 0o700 != 0o700:
            raise ValueError("must give the owner rwx (0700, 0750, ...)")
        if bits & 0o022:
            raise ValueError("must not let the group or others write (0700, 0750, ...)")
        return f"0{bits:o}"

    @property
    def mode_bits(self) -> int:
        return int(self.mode, 8)


class PrecisionConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"


class LogConfig(Section):
    """The part of ``train`` a Guard reads (the built-in trainer's ``train`` has the rest)."""

    log_every: int = Field(default=10, ge=1)


class CheckpointConfig(Section):
    every: int | None = Field(
        default=None, ge=1, description="Save every N steps; null: on the time cadence instead."
    )
    every_seconds: float | None = Field(
        default=DEFAULT_CHECKPOINT_SECONDS,
        gt=0.0,
        description="When every is null: save once this many seconds have passed since the "
        "last save (the crash path); null: no periodic saves.",
    )
    keep_last: int = Field(default=3, ge=1, description="Newest checkpoints kept.")
    async_save: bool = Field(
        default=True,
        alias="async",
        description="Copy state at the step boundary, write it in a background thread.",
    )
    save_on_exit: bool = Field(
        default=True, description="Save when training ends (stop and signals always save)."
    )

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False
    )


class SnapshotConfig(Section):
    every: int | None = Field(
        default=50, ge=1, description="Copy the state to host memory every N steps; null: off."
    )
    keep: int = Field(default=2, ge=1, description="Newest snapshots kept (and the last good).")
    budget: MemoryBudget = Field(
        default=MemoryBudget("25%"),
        description="Host memory for snapshots: a size (8GiB, 512MB, bytes) or a percentage "
        "of physical memory, shared by the ranks on the host.",
    )


class MitigationConfig(Section):
    skip_spikes: bool = Field(
        default=False,
        description="Rung 1: skip on the device the update of a step whose loss (or another "
        "of signals) is a spike (needs a fused AdamW or SPAM, optim.name).",
    )
    signals: list[Literal["loss", "grad_norm"]] = Field(
        default=["loss"],
        min_length=1,
        description="The signals whose spike skips a step: loss, grad_norm. A small-batch "
        "gradient norm is heavy-tailed (see docs/configuration.md).",
    )
    zscore: float = Field(default=6.0, gt=0.0, description="Spike: > k std above the mean.")
    min_history: int = Field(
        default=64, ge=2, description="Window values (of telemetry.spikes) before skipping."
    )
    max_consecutive: int = Field(
        default=3, ge=1, description="Skips in a row; one more spike ends the rung."
    )


class TimeoutsConfig(Section):
    """The part of ``distributed`` a Guard reads: how long its collectives wait (the built-in
    trainer's ``distributed`` adds the sharding)."""

    timeout: Duration = Field(
        default=Duration("10m"),
        description="How long a collective waits for the other ranks before the rank ends "
        "(exit code 75 naming it; on GPUs NCCL's watchdog aborts a device collective): the "
        "process group's timeout (the built-in trainer's group; a Guard's control and dcp "
        "groups). A Prometheus duration, at least 10s.",
    )

    stop_grace: Duration = Field(
        default=Duration("20s"),
        description="After a stop signal or stop command: how long a rank may stay blocked in "
        "one collective before it is taken for stuck and ends with exit code 75. Keep it "
        "under the scheduler's grace (torchrun and Kubernetes: 30 s) and above the time a "
        "save takes. A Prometheus duration, at least 5s.",
    )

    @field_validator("timeout", "stop_grace")
    @classmethod
    def _at_least(cls, value: Duration, info: ValidationInfo) -> Duration:
        floor = MIN_TIMEOUT_S if info.field_name == "timeout" else MIN_STOP_GRACE_S
        if value.seconds < floor:
            raise ValueError(f"must be at least {floor:.0f}s, not {value!r}")
        return value


class ControlConfig(Section):
    socket: bool = Field(default=True, description="Serve run_dir/control.sock (mode 0600).")
    tcp: str | None = Field(
        default=None,
        pattern=r"^[^:\s]+:\d{1,5}$",
        description="Also serve TCP on HOST:PORT (port 0: any free); needs the token.",
    )
    advertise: str | None = Field(
        default=None,
        pattern=r"^[^:\s]+:\d{1,5}$",
        description="The TCP address peers on other hosts dial (exported on "
        "lossguard_agent_info); default: the tcp address, a wildcard host as the host name "
        "(on Kubernetes: the pod IP, $(POD_IP):9420).",
    )
    token_env: str = Field(
        default=DEFAULT_TOKEN_ENV,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable that holds the TCP bearer token (read at start).",
    )

    @model_validator(mode="after")
    def _addresses(self) -> ControlConfig:
        if self.tcp is not None and int(self.tcp.rpartition(":")[2]) > 65535:
            raise field_error("tcp", "port must be <= 65535")
        if self.advertise is not None:
            if self.tcp is None:
                raise field_error("advertise", "needs control.tcp: there is no TCP to advertise")
            if not 0 < int(self.advertise.rpartition(":")[2]) <= 65535:
                raise field_error("advertise", "port must be 1 to 65535")
        return self


class WandbConfig(Section):
    enabled: bool = False
    project: str = "lossguard"
    entity: str | None = None
    tags: list[str] = Field(default_factory=list)
    mode: Literal["auto", "online", "offline"] = Field(
        default="auto", description="auto: offline when WANDB_API_KEY is not set."
    )
    dir: Path | None = Field(default=None, description="Default: the run directory.")


class GuardConfig(Section):
    """What a Guard reads: ``run`` (its id and directory mode), ``train.log_every``,
    ``precision``, ``distributed`` (timeouts), ``checkpoint``, ``snapshot``, ``mitigation``,
    ``control``, ``telemetry`` and ``wandb``."""

    run: RunConfig = Field(default_factory=RunConfig)
    train: LogConfig = Field(default_factory=LogConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    distributed: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    mitigation: MitigationConfig = Field(default_factory=MitigationConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @property
    def compiled_model(self) -> bool:
        """Whether the model is compiled (FP8 health sampling needs an eager one): not known
        to a Guard's config, taken as eager; the built-in trainer's says (``model.compile``)."""
        return False

    @model_validator(mode="after")
    def _skip_window_fits(self) -> GuardConfig:
        window = self.telemetry.spikes.window
        if self.mitigation.skip_spikes and self.mitigation.min_history > window:
            raise field_error(
                "mitigation.min_history", f"must be <= telemetry.spikes.window ({window})"
            )
        return self

    @model_validator(mode="after")
    def _fidelity_needs_fp8(self) -> GuardConfig:
        if self.telemetry.fp8_fidelity.enabled and self.precision.dtype != "fp8":
            raise field_error(
                "telemetry.fp8_fidelity.enabled",
                f"needs precision.dtype fp8 (not {self.precision.dtype}): the check compares "
                "the FP8 layers with a high-precision copy",
            )
        return self

    def resolved(self) -> dict[str, Any]:
        """Plain data, as written to ``config.yaml`` in the run directory."""
        return self.model_dump(mode="json", by_alias=True)

    def digest(self) -> str:
        """Stable short hash of the resolved config."""
        blob = json.dumps(self.resolved(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
