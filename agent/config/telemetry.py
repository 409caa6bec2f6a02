"""The ``telemetry`` section of a Guard's config: the exporter, spike detection, FP8 health and
fidelity, gradient diagnostics (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lossguard.common.config import Section, field_error


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
