"""The agent's typed run configuration: YAML in, validated pydantic model out (torch-free).
The plumbing (sections, one-line errors, overrides, YAML reading) is ``lossguard.common.config``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from lossguard.common.config import Section, field_error, read_config_file, seconds, validate
from lossguard.common.control.bearer import DEFAULT_TOKEN_ENV, token_from_env
from lossguard.common.sizes import parse_budget

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
    compile: bool = Field(
        default=False,
        description="torch.compile the model (under fsdp2/hsdp: each transformer block, "
        "before it is sharded).",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        default="inductor",
        description="The torch.compile backend: inductor generates kernels; aot_eager and "
        "eager only trace (quick to compile, for checks).",
    )

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
    cache_dir: Path | None = Field(
        default=None,
        description="Where tokenised text is cached, a folder of this user's (0700). Default: "
        "<run.dir>/.cache-<uid>.",
    )

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


class OptimConfig(Section):
    name: Literal["adamw", "spam"] = Field(
        default="adamw",
        description="adamw: torch's fused AdamW; spam: SPAM (spike-aware Adam with momentum "
        "reset, Huang et al. 2025). Both take lr, beta1, beta2 and weight_decay from train.",
    )
    reset_every: int = Field(
        default=500, ge=1, description="spam: steps between momentum resets (delta T)."
    )
    reset_warmup: int = Field(
        default=150, ge=0, description="spam: steps of cosine step-size warm-up after a reset."
    )
    threshold: float = Field(
        default=5000.0,
        gt=0.0,
        description="spam: clip a gradient entry whose square exceeds threshold x its second "
        "moment.",
    )
    clip_after: int = Field(
        default=20,
        ge=1,
        description="spam: steps after the start and after each reset before clipping (the "
        "second moment is zero at a reset).",
    )
    eps: float = Field(default=1e-6, gt=0.0, description="spam: the denominator's epsilon.")

    @model_validator(mode="after")
    def _fits_the_reset_interval(self) -> OptimConfig:
        if self.clip_after >= self.reset_every:
            raise field_error(
                "clip_after", f"must be < reset_every ({self.reset_every}), else nothing is clipped"
            )
        if self.reset_warmup > self.reset_every:
            raise field_error("reset_warmup", f"must be <= reset_every ({self.reset_every})")
        return self


class PrecisionConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"


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
    budget: str = Field(
        default="25%",
        description="Host memory for snapshots: a size (8GiB, 512MB, bytes) or a percentage "
        "of physical memory, shared by the ranks on the host.",
    )

    @model_validator(mode="after")
    def _budget_is_a_size(self) -> SnapshotConfig:
        try:
            parse_budget(self.budget)
        except ValueError as exc:
            raise field_error("budget", str(exc)) from None
        return self


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


class DistributedConfig(Section):
    strategy: Literal["ddp", "fsdp2", "hsdp"] = Field(
        default="ddp",
        description="Under torchrun: ddp replicates the model; fsdp2 shards parameters, "
        "gradients and optimizer state over all ranks (fully_shard per block and at the root); "
        "hsdp shards within groups and replicates across them.",
    )
    replicate: int | None = Field(
        default=None, ge=1, description="hsdp: replica groups (the world size divides by it)."
    )
    activation_checkpointing: bool = Field(
        default=False, description="fsdp2/hsdp: recompute each block's activations in backward."
    )
    timeout: str = Field(
        default="10m",
        description="How long a collective waits for the other ranks before the rank ends "
        "(exit code 75 naming it; on GPUs NCCL's watchdog aborts a device collective): the "
        "process group's timeout (the built-in trainer's group; a Guard's control and dcp "
        "groups). A Prometheus duration, at least 10s.",
    )

    stop_grace: str = Field(
        default="20s",
        description="After a stop signal or stop command: how long a rank may stay blocked in "
        "one collective before it is taken for stuck and ends with exit code 75. Keep it "
        "under the scheduler's grace (torchrun and Kubernetes: 30 s) and above the time a "
        "save takes. A Prometheus duration, at least 5s.",
    )

    @field_validator("timeout", "stop_grace")
    @classmethod
    def _at_least(cls, value: str, info: ValidationInfo) -> str:
        floor = MIN_TIMEOUT_S if info.field_name == "timeout" else MIN_STOP_GRACE_S
        if seconds(value) < floor:
            raise ValueError(f"must be at least {floor:.0f}s, not {value!r}")
        return value

    @property
    def timeout_s(self) -> float:
        return seconds(self.timeout)

    @property
    def stop_grace_s(self) -> float:
        return seconds(self.stop_grace)

    @property
    def sharded(self) -> bool:
        return self.strategy != "ddp"


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
        description="Environment variable that holds the TCP bearer token.",
    )

    @model_validator(mode="after")
    def _tcp_needs_token(self) -> ControlConfig:
        if self.tcp is not None and int(self.tcp.rpartition(":")[2]) > 65535:
            raise field_error("tcp", "port must be <= 65535")
        if self.advertise is not None:
            if self.tcp is None:
                raise field_error("advertise", "needs control.tcp: there is no TCP to advertise")
            if not 0 < int(self.advertise.rpartition(":")[2]) <= 65535:
                raise field_error("advertise", "port must be 1 to 65535")
        if self.tcp is not None:
            try:
                token_from_env(self.token_env)
            except ValueError as exc:
                raise field_error("tcp", str(exc)) from None
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
    level_shift_after: int = Field(
        default=100,
        description="Steps of a loss episode after which a flat or falling step-up, with a calm "
        "grad norm, is taken as the new level; keep it below LossSpikeNotRecovering's 300.",
    )

    @model_validator(mode="after")
    def _lengths_fit(self) -> SpikeConfig:
        if self.min_history > self.window:
            raise field_error("min_history", f"must be <= window ({self.window})")
        if self.level_shift_after <= self.recover_steps:
            raise field_error(
                "level_shift_after", f"must be > recover_steps ({self.recover_steps})"
            )
        return self


class Fp8HealthConfig(Section):
    every: int = Field(default=100, ge=1, description="Sample FP8 amax/overflow every K steps.")


class Fp8FidelityConfig(Section):
    enabled: bool = Field(
        default=False, description="Check FP8 gradients against a high-precision shadow model."
    )
    every: int = Field(default=1000, ge=1, description="Check every K steps.")
    dtype: Literal["fp32", "bf16"] = Field(
        default="fp32", description="The shadow's precision: fp32, or bf16 autocast."
    )


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
    fp8_fidelity: Fp8FidelityConfig = Field(default_factory=Fp8FidelityConfig)
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
    "lr_scale",
    "nonfinite_loss",
    "loss_shift",
    "corrupt_batch",
    "scale_activations",
    "activation_outlier",
    "slow_step",
    "slow_save",
    "hang",
    "crash",
]


class FaultConfig(Section):
    kind: FaultKind
    step: int = Field(ge=1, description="First step (1-based) the fault perturbs.")
    duration: int = Field(default=1, ge=1, description="Steps it lasts.")
    factor: float = Field(
        default=10.0, gt=0.0, description="lr_scale / scale_activations multiplier."
    )
    seconds: float = Field(
        default=1.0, gt=0.0, description="slow_step, slow_save: added wall time."
    )
    amount: float = Field(default=0.3, description="loss_shift: added to the step's loss.")
    once: bool = Field(
        default=False,
        description="A transient fault: it perturbs the first pass over its steps only, not a "
        "replay of them after a rollback or resume in the same process.",
    )
    ranks: list[int] | None = Field(
        default=None,
        description="The ranks it perturbs (null: every rank), as a fault on one rank's batch "
        "or host is in a real run.",
    )

    @field_validator("ranks")
    @classmethod
    def _distinct_ranks(cls, ranks: list[int] | None) -> list[int] | None:
        if ranks is not None and not ranks:
            raise ValueError("must list at least one rank (leave it out for every rank)")
        if ranks is not None and (min(ranks) < 0 or len(set(ranks)) != len(ranks)):
            raise ValueError(f"must be distinct ranks >= 0, not {ranks}")
        return ranks


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    mitigation: MitigationConfig = Field(default_factory=MitigationConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    faults: list[FaultConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _skip_window_fits(self) -> Config:
        window = self.telemetry.spikes.window
        if self.mitigation.skip_spikes and self.mitigation.min_history > window:
            raise field_error(
                "mitigation.min_history", f"must be <= telemetry.spikes.window ({window})"
            )
        return self

    @model_validator(mode="after")
    def _fidelity_needs_fp8(self) -> Config:
        if self.telemetry.fp8_fidelity.enabled and self.precision.dtype != "fp8":
            raise field_error(
                "telemetry.fp8_fidelity.enabled",
                f"needs precision.dtype fp8 (not {self.precision.dtype}): the check compares "
                "the FP8 layers with a high-precision copy",
            )
        return self

    @model_validator(mode="after")
    def _sharding_combinations(self) -> Config:
        dist = self.distributed
        if dist.strategy == "hsdp" and dist.replicate is None:
            raise field_error("distributed.replicate", "hsdp needs the number of replica groups")
        if dist.strategy != "hsdp" and dist.replicate is not None:
            raise field_error("distributed.replicate", f"only with hsdp, not {dist.strategy}")
        if dist.activation_checkpointing and not dist.sharded:
            raise field_error("distributed.activation_checkpointing", "only with fsdp2 or hsdp")
        if not dist.sharded:
            return self
        refused = {
            "precision.dtype": self.precision.dtype == "fp16"
            and "fp16 needs a GradScaler, which lossguard does not run under FSDP2: use bf16",
            "train.ema_decay": self.train.ema_decay is not None
            and "the weight EMA is not kept for sharded models",
            "telemetry.fp8_fidelity.enabled": self.telemetry.fp8_fidelity.enabled
            and "the FP8 fidelity shadow copies the whole model: not under FSDP2",
        }
        for name, why in refused.items():
            if why:
                raise field_error(name, f"{why} (distributed.strategy {dist.strategy})")
        return self

    def resolved(self) -> dict[str, Any]:
        """Plain data, as written to ``config.yaml`` in the run directory."""
        return self.model_dump(mode="json", by_alias=True)

    def digest(self) -> str:
        """Stable short hash of the resolved config."""
        blob = json.dumps(self.resolved(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def parse_config(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Validate plain data (plus overrides) into a Config, or raise ConfigError."""
    return validate(Config, json.loads(json.dumps(dict(data), default=str)), overrides)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config file, apply ``--set`` overrides and validate."""
    return parse_config(read_config_file(path), overrides)
