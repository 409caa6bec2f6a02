"""Typed run configuration: YAML in, validated pydantic model out (torch-free).

Every error names the full key path and the reason on one line, e.g. ``train.lr: must be > 0``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A configuration problem, phrased as one line that names the key and the reason."""


def field_error(field: str, reason: str) -> PydanticCustomError:
    """An error from a section-level check that names the field it is about."""
    return PydanticCustomError("field_error", "{reason}", {"field": field, "reason": reason})


class Section(BaseModel):
    """A config section: unknown keys and non-finite numbers are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(Section):
    id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        max_length=128,
        description="Run name; the run directory is <dir>/<id>. Default: <timestamp>.",
    )
    dir: Path = Field(default=Path("runs"), description="Root folder that holds run directories.")
    seed: int = Field(default=1337, ge=0, description="Seed of model init, sampling and dropout.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto = cuda when available, else cpu."
    )


class ModelConfig(Section):
    n_layer: int = Field(default=4, ge=1)
    n_head: int = Field(default=4, ge=1)
    n_embd: int = Field(default=128, ge=1)
    block_size: int = Field(default=128, ge=2, description="Context length in tokens.")
    vocab_size: int | None = Field(
        default=None, ge=2, description="Default: the data's vocabulary (256 for text)."
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    bias: bool = True
    compile: bool = Field(default=False, description="Wrap the model in torch.compile.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.n_embd % self.n_head:
            raise field_error("n_embd", f"must be divisible by n_head ({self.n_head})")
        return self


class DataConfig(Section):
    kind: Literal["text", "tokens", "synthetic"] = Field(
        default="text",
        description="text: UTF-8 files tokenised as bytes; tokens: nanoGPT train.bin/val.bin; "
        "synthetic: uniform random tokens (benchmarks only).",
    )
    path: Path | None = Field(
        default=None,
        description="text: a file or folder (default: the Python standard library's sources); "
        "tokens: the folder holding train.bin and val.bin.",
    )
    include: list[str] = Field(
        default_factory=lambda: ["*.py"],
        description="Filename patterns read from a text folder.",
    )
    max_bytes: int | None = Field(default=None, gt=0, description="Cap on the text corpus size.")
    val_fraction: float = Field(default=0.05, gt=0.0, lt=1.0)
    cache_dir: Path | None = Field(default=None, description="Default: <run.dir>/.cache.")

    @model_validator(mode="after")
    def _path_fits_kind(self) -> DataConfig:
        if self.kind == "tokens":
            if self.path is None:
                raise field_error("path", "required when kind is 'tokens'")
            for split in ("train.bin", "val.bin"):
                if not (self.path / split).is_file():
                    raise field_error("path", f"no such file: {self.path / split}")
        elif self.kind == "text" and self.path is not None and not self.path.exists():
            raise field_error("path", f"no such file or directory: {self.path}")
        return self


class EarlyStoppingConfig(Section):
    patience: int = Field(ge=1, description="Evaluations without improvement, after warmup.")
    min_delta: float = Field(default=0.0, ge=0.0)


class TrainConfig(Section):
    max_steps: int = Field(default=1000, ge=1)
    batch_size: int = Field(default=16, ge=1, description="Sequences per micro-batch per rank.")
    grad_accum: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    lr: float = Field(default=1e-3, gt=0.0)
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="Final lr / peak lr.")
    warmup_steps: int = Field(default=100, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(default=0.1, ge=0.0)
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    grad_clip: float | None = Field(default=1.0, gt=0.0, description="Max grad norm; null: off.")
    ema_decay: float | None = Field(default=None, gt=0.0, lt=1.0)
    eval_every: int = Field(default=100, ge=1)
    eval_batches: int = Field(default=20, ge=1)
    log_every: int = Field(default=10, ge=1)
    early_stopping: EarlyStoppingConfig | None = None


class PrecisionConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"


class CheckpointConfig(Section):
    every: int | None = Field(default=None, ge=1, description="Save every N steps; null: off.")
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


class ControlConfig(Section):
    socket: bool = Field(default=True, description="Serve run_dir/control.sock (mode 0600).")
    tcp: str | None = Field(
        default=None,
        pattern=r"^[^:\s]+:\d{1,5}$",
        description="Also serve TCP on HOST:PORT (port 0: any free); needs the token.",
    )
    token_env: str = Field(
        default="LOSSGUARD_CONTROL_TOKEN",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable that holds the TCP bearer token.",
    )

    @model_validator(mode="after")
    def _tcp_needs_token(self) -> ControlConfig:
        if self.tcp is not None and int(self.tcp.rpartition(":")[2]) > 65535:
            raise field_error("tcp", "port must be <= 65535")
        if self.tcp is not None and not os.environ.get(self.token_env):
            raise field_error("tcp", f"needs a token in the environment variable {self.token_env}")
        return self


class SpikeConfig(Section):
    window: int = Field(default=128, ge=8, description="Steps in the rolling window.")
    mode: Literal["zscore", "ratio"] = Field(
        default="zscore", description="zscore: > k std above the mean; ratio: >= ratio x mean."
    )
    zscore: float = Field(default=6.0, gt=0.0, description="k, in standard deviations.")
    ratio: float = Field(default=2.0, gt=1.0, description="Spike when value >= ratio x mean.")
    min_history: int = Field(default=32, ge=2, description="Window values before detecting.")
    recover_steps: int = Field(
        default=20, ge=1, description="M: steps back within the band that end an episode."
    )

    @model_validator(mode="after")
    def _history_fits_window(self) -> SpikeConfig:
        if self.min_history > self.window:
            raise field_error("min_history", f"must be <= window ({self.window})")
        return self


class Fp8HealthConfig(Section):
    every: int = Field(default=100, ge=1, description="Sample FP8 amax/overflow every K steps.")


class GradDiagnosticsConfig(Section):
    enabled: bool = False
    every: int = Field(default=100, ge=1, description="Sample every K steps.")
    top_k: int = Field(default=5, ge=1, le=50, description="Layers exported to Prometheus.")
    vanishing: float = Field(default=1e-7, gt=0.0, description="Layer grad L2 below: vanishing.")
    exploding: float = Field(default=1e2, gt=0.0, description="Layer grad L2 above: exploding.")


class TelemetryConfig(Section):
    enabled: bool = Field(
        default=True, description="Exporter, detectors and samplers; off: a bare loop."
    )
    host: str = Field(default="0.0.0.0", description="Exporter bind address.")
    port: int = Field(
        default=9410, ge=0, le=65535, description="Exporter port (+ local rank); 0: any free."
    )
    peak_flops: float | None = Field(
        default=None, gt=0.0, description="Dense peak FLOP/s for MFU; overrides table/measured."
    )
    skip_nonfinite: bool = Field(
        default=True, description="Skip the optimizer update of a step with a non-finite value."
    )
    spikes: SpikeConfig = Field(default_factory=SpikeConfig)
    fp8: Fp8HealthConfig = Field(default_factory=Fp8HealthConfig)
    grad_diagnostics: GradDiagnosticsConfig = Field(default_factory=GradDiagnosticsConfig)


class WandbConfig(Section):
    enabled: bool = False
    project: str = "lossguard"
    entity: str | None = None
    tags: list[str] = Field(default_factory=list)
    mode: Literal["auto", "online", "offline"] = Field(
        default="auto", description="auto: offline when WANDB_API_KEY is not set."
    )
    dir: Path | None = Field(default=None, description="Default: the run directory.")


FaultKind = Literal[
    "lr_scale", "nonfinite_loss", "corrupt_batch", "scale_activations", "slow_step", "hang", "crash"
]


class FaultConfig(Section):
    kind: FaultKind
    step: int = Field(ge=1, description="First step (1-based) the fault perturbs.")
    duration: int = Field(default=1, ge=1, description="Steps it lasts.")
    factor: float = Field(
        default=10.0, gt=0.0, description="lr_scale / scale_activations multiplier."
    )
    seconds: float = Field(default=1.0, gt=0.0, description="slow_step: added wall time.")


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    faults: list[FaultConfig] = Field(default_factory=list)

    def resolved(self) -> dict[str, Any]:
        """Plain data, as written to ``config.yaml`` in the run directory."""
        return self.model_dump(mode="json", by_alias=True)

    def digest(self) -> str:
        """Stable short hash of the resolved config."""
        blob = json.dumps(self.resolved(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_REASONS: dict[str, str] = {
    "extra_forbidden": "unknown key",
    "missing": "required key is missing",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "path_type": "must be a path",
    "list_type": "must be a list",
    "model_type": "must be a mapping of keys",
    "model_attributes_type": "must be a mapping of keys",
    "finite_number": "must be a finite number",
}

_PATTERN_REASONS: dict[str, str] = {
    "id": "may hold only letters, digits, '.', '_' and '-', and start with a letter or digit",
    "tcp": "must be HOST:PORT, e.g. 127.0.0.1:9420",
    "token_env": "must be an environment variable name",
}

_BOUNDS: dict[str, str] = {
    "greater_than": "gt",
    "greater_than_equal": "ge",
    "less_than": "lt",
    "less_than_equal": "le",
}
_BOUND_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _reason(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind in _BOUNDS:
        bound = _BOUNDS[kind]
        limit = ctx[bound]
        shown = f"{limit:g}" if isinstance(limit, float) else str(limit)
        return f"must be {_BOUND_SYMBOLS[bound]} {shown}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind == "string_pattern_mismatch":
        return _PATTERN_REASONS.get(str(error["loc"][-1]), f"must match {ctx.get('pattern')}")
    if kind in ("value_error", "field_error"):
        return str(ctx.get("reason") or ctx.get("error") or error["msg"])
    return _REASONS.get(kind, str(error["msg"]).lower())


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming every failing key path and why."""
    parts = []
    for error in exc.errors():
        loc = [str(p) for p in error["loc"]]
        if error["type"] == "field_error":
            loc.append(str(error["ctx"]["field"]))
        path = ".".join(loc)
        reason = _reason(error)
        parts.append(f"{path}: {reason}" if path else reason)
    return "; ".join(parts)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides; the value is read as a YAML scalar (``1e-3``, ``true``)."""
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {override}: expected KEY=VALUE, e.g. train.lr=3e-4")
        parts = key.strip().split(".")
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(f"--set {override}: {prefix} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or "invalid YAML"
            raise ConfigError(f"--set {override}: value is not valid YAML ({problem})") from None
    return data


def parse_config(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Validate plain data (plus overrides) into a Config, or raise ConfigError."""
    merged = apply_overrides(json.loads(json.dumps(dict(data), default=str)), overrides)
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config file, apply ``--set`` overrides and validate."""
    return parse_config(read_config_file(path), overrides)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file (empty for an empty file), or ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data
