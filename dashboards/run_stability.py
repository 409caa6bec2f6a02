"""The run dashboard's Stability row: loss, gradient norms, spikes and non-finite values,
skipped steps and the precision's health (fp16 loss scale, FP8 overflow and fidelity)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from dashboards.panels import (
    COUNT_BAD,
    FIDELITY,
    FIDELITY_ONLY,
    FP8_ONLY,
    FP8_RATIO,
    FP16_ONLY,
    SEL,
    ZSCORE,
    graph,
)


def stability_row(dashboard: db.Dashboard, by_run: str) -> db.Dashboard:
    """``dashboard`` with the Stability row appended (``by_run``: the per-run legend)."""
    return (
        dashboard.with_row(db.Row("Stability"))
        .with_panel(
            graph(
                "Loss",
                "Training loss (mean over the log interval) and validation loss per run.",
                "none",
                [
                    (f"avg by (run_id) (lossguard_train_loss{{{SEL}}})", "{{run_id}} train"),
                    (f"avg by (run_id) (lossguard_val_loss{{{SEL}}})", "{{run_id}} val"),
                ],
            )
        )
        .with_panel(
            graph(
                "Loss and grad norm z-score",
                "The last step against the rolling window, in standard deviations; the spike "
                "detector's default threshold is 6.",
                "none",
                [
                    (f"max by (run_id) (lossguard_loss_zscore{{{SEL}}})", "{{run_id}} loss"),
                    (
                        f"max by (run_id) (lossguard_grad_norm_zscore{{{SEL}}})",
                        "{{run_id}} grad norm",
                    ),
                ],
                ZSCORE,
            )
        )
        .with_panel(
            graph(
                "Grad norm",
                "Global gradient norm before clipping, per rank.",
                "none",
                [(f"lossguard_grad_norm{{{SEL}}}", "{{run_id}} r{{rank}}")],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Spikes, non-finite values, skipped steps",
                "Spike episodes started, NaN/Inf seen and optimizer steps skipped, per interval "
                "(the detectors reduce over ranks, so max over ranks).",
                "short",
                [
                    (
                        f"max by (run_id, signal) "
                        f"(increase(lossguard_spikes_total{{{SEL}}}[$__rate_interval]))",
                        "{{run_id}} spikes {{signal}}",
                    ),
                    (
                        f"max by (run_id, signal) "
                        f"(increase(lossguard_nonfinite_total{{{SEL}}}[$__rate_interval]))",
                        "{{run_id}} non-finite {{signal}}",
                    ),
                    (
                        f"max by (run_id, reason) "
                        f"(increase(lossguard_skipped_steps_total{{{SEL}}}[$__rate_interval]))",
                        "{{run_id}} skipped steps ({{reason}})",
                    ),
                ],
                COUNT_BAD,
                bars=True,
                width=8,
            )
        )
        .with_panel(
            graph(
                "Gradient diagnostics",
                "Layers with a vanishing or exploding gradient, and the largest fraction of rows "
                "with an all-zero gradient (dead neurons, right axis), worst rank.",
                "short",
                [
                    (
                        f"max by (run_id) (lossguard_grad_vanishing_layers{{{SEL}}})",
                        "{{run_id}} vanishing layers",
                    ),
                    (
                        f"max by (run_id) (lossguard_grad_exploding_layers{{{SEL}}})",
                        "{{run_id}} exploding layers",
                    ),
                    (
                        f"max by (run_id) (lossguard_grad_dead_neuron_ratio{{{SEL}}})",
                        "{{run_id}} dead neuron ratio",
                    ),
                ],
                COUNT_BAD,
                width=8,
            ).override_by_regexp(
                ".*ratio$",
                [
                    dm.DynamicConfigValue(id_val="unit", value="percentunit"),
                    dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                ],
            )
        )
        .with_panel(
            graph(
                "AMP loss scale",
                "fp16 GradScaler loss scale; repeated halving means overflowing gradients.",
                "short",
                [(f"min by (run_id) (lossguard_amp_loss_scale{{{SEL}}})", by_run)],
                width=8,
                no_value=FP16_ONLY,
            )
        )
        .with_panel(
            graph(
                "FP8 amax",
                "FP8 amax of the worst Float8Linear layer, per tensor.",
                "short",
                [
                    (
                        f"max by (run_id, tensor) (lossguard_fp8_amax{{{SEL}}})",
                        "{{run_id}} {{tensor}}",
                    )
                ],
                width=8,
                no_value=FP8_ONLY,
            )
        )
        .with_panel(
            graph(
                "FP8 overflow / underflow",
                "Fraction of values saturating (overflow) or flushed to zero (underflow) in FP8, "
                "worst layer, per tensor.",
                "percentunit",
                [
                    (
                        f"max by (run_id, tensor) (lossguard_fp8_overflow_ratio{{{SEL}}})",
                        "{{run_id}} overflow {{tensor}}",
                    ),
                    (
                        f"max by (run_id, tensor) (lossguard_fp8_underflow_ratio{{{SEL}}})",
                        "{{run_id}} underflow {{tensor}}",
                    ),
                ],
                FP8_RATIO,
                width=8,
                no_value=FP8_ONLY,
            )
        )
        .with_panel(
            graph(
                "FP8 fidelity (worst layer gradient cosine)",
                "The sampled FP8 fidelity check (telemetry.fp8_fidelity): cosine similarity of "
                "the FP8 and high-precision gradients in the worst layer (named in the legend), "
                "lowest over ranks; below 0.9 FP8FidelityLow fires. Right axis: relative error "
                "of the FP8 loss. Each value holds until the next check.",
                "none",
                [
                    (
                        f"min by (run_id, layer) (lossguard_fp8_fidelity_min_grad_cosine{{{SEL}}})",
                        "{{run_id}} {{layer}}",
                    ),
                    (
                        f"max by (run_id) (lossguard_fp8_fidelity_loss_rel_error{{{SEL}}})",
                        "{{run_id}} loss rel error",
                    ),
                ],
                FIDELITY,
                width=8,
                no_value=FIDELITY_ONLY,
            ).override_by_regexp(
                ".*loss rel error$",
                [
                    dm.DynamicConfigValue(id_val="unit", value="percentunit"),
                    dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                ],
            )
        )
    )
