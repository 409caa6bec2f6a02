"""The built-in trainer's config (``lossguard-agent run``; torch-free): a Guard's sections
(``guard.py``) and the trainer's own, ``model``, ``data``, ``optim`` and ``faults``, with the
whole of ``train`` and ``distributed``. One YAML file holds both."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from lossguard.agent.config.guard import GuardConfig, LogConfig, TimeoutsConfig
from lossguard.common.config import Section, field_error


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
    def _tokens_need_a_path(self) -> DataConfig:
        if self.kind == "tokens" and self.path is None:
            raise field_error("path", "required when kind is 'tokens'")
        return self


class EarlyStoppingConfig(Section):
    patience: int = Field(ge=1, description="Evaluations without improvement, after warmup.")
    min_delta: float = Field(default=0.0, ge=0.0)


class TrainConfig(LogConfig):
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


class DistributedConfig(TimeoutsConfig):
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

    @property
    def sharded(self) -> bool:
        return self.strategy != "ddp"


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


class TrainerConfig(GuardConfig):
    """The built-in trainer's config: a GuardConfig with the trainer's sections."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    faults: list[FaultConfig] = Field(default_factory=list)

    @property
    def compiled_model(self) -> bool:
        return self.model.compile

    @model_validator(mode="after")
    def _sharding_combinations(self) -> TrainerConfig:
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


Config = TrainerConfig
"""The name importers of ``lossguard.agent.config`` know the trainer's config by."""
