"""The run dashboard (``lossguard-run``)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from dashboards.panels import (
    COUNT_BAD,
    FRACTION_HIGH_BAD,
    GPU_ONLY,
    RUN,
    SEL,
    TEMPERATURE,
    UTIL_LOW_BAD,
    annotation,
    base,
    graph,
    quantiles,
    query_variable,
    single,
)
from dashboards.run_dcgm import dcgm_row
from dashboards.run_stability import stability_row


def run_dashboard() -> db.Dashboard:
    """One or more runs (run_id and rank variables): overview, stability, throughput, memory and
    GPU, checkpoints and actions, the GPUs from DCGM; spikes, rollbacks and firing alerts as
    annotations."""
    by_run = "{{run_id}}"
    overview = (
        base("lossguard-run", "lossguard run", "A training run watched by lossguard.")
        .with_variable(query_variable("run_id", "Run", "label_values(lossguard_step, run_id)"))
        .with_variable(
            query_variable("rank", "Rank", f"label_values(lossguard_step{{{RUN}}}, rank)")
        )
        .annotation(
            annotation(
                "Spikes",
                f"max by (run_id, signal) (changes(lossguard_spikes_total{{{RUN}}}[1m])) > 0",
                "orange",
            )
        )
        .annotation(
            annotation(
                "Rollbacks",
                f"max by (run_id) (increase(lossguard_rollbacks_total{{{RUN}}}[1m])) > 0",
                "purple",
            )
        )
        .annotation(annotation("Firing alerts", f'ALERTS{{alertstate="firing", {RUN}}}', "red"))
        .with_row(db.Row("Overview"))
        .with_panel(
            single(
                "Step",
                "Last completed optimizer step of each run (lossguard_step).",
                "none",
                [(f"max by (run_id) (lossguard_step{{{SEL}}})", by_run)],
            )
        )
        .with_panel(
            single(
                "Progress",
                "Step over the planned last step (lossguard_step / lossguard_step_target).",
                "percentunit",
                [
                    (
                        f"max by (run_id) (lossguard_step{{{SEL}}})"
                        f" / max by (run_id) (lossguard_step_target{{{SEL}}})",
                        by_run,
                    )
                ],
            )
        )
        .with_panel(
            single(
                "ETA",
                "Time to the planned last step at the step rate of the last 15 minutes.",
                "s",
                [
                    (
                        f"(max by (run_id) (lossguard_step_target{{{SEL}}})"
                        f" - max by (run_id) (lossguard_step{{{SEL}}}))"
                        f" / max by (run_id) (rate(lossguard_step{{{SEL}}}[15m]))",
                        by_run,
                    )
                ],
            )
        )
        .with_panel(
            single(
                "Train / val loss",
                "Mean training loss over the last log interval and the last validation loss.",
                "none",
                [
                    (f"avg by (run_id) (lossguard_train_loss{{{SEL}}})", "{{run_id}} train"),
                    (f"avg by (run_id) (lossguard_val_loss{{{SEL}}})", "{{run_id}} val"),
                ],
            )
        )
        .with_panel(
            single(
                "Tokens/s",
                "Tokens per second over the last log interval, summed over ranks.",
                "short",
                [(f"sum by (run_id) (lossguard_tokens_per_second{{{SEL}}})", by_run)],
            )
        )
        .with_panel(
            single(
                "MFU",
                "Model FLOPs utilisation against the dense peak, mean over ranks.",
                "percentunit",
                [(f"avg by (run_id) (lossguard_mfu_ratio{{{SEL}}})", by_run)],
                UTIL_LOW_BAD,
            )
        )
        .with_panel(
            single(
                "Peak memory",
                "Peak allocated device memory over the limit, worst rank.",
                "percentunit",
                [
                    (
                        f'max by (run_id) (lossguard_device_memory_bytes{{kind="peak_allocated",'
                        f" {SEL}}} / ignoring(kind)"
                        f" lossguard_device_memory_limit_bytes{{{SEL}}})",
                        by_run,
                    )
                ],
                FRACTION_HIGH_BAD,
            )
        )
        .with_panel(
            single(
                "Firing alerts",
                "Prometheus alerts firing for the selected runs (ALERTS).",
                "none",
                [(f'count(ALERTS{{alertstate="firing", {RUN}}}) or vector(0)', "firing")],
                COUNT_BAD,
            )
        )
    )
    board = (
        stability_row(overview, by_run)
        .with_row(db.Row("Throughput and efficiency"))
        .with_panel(
            graph(
                "Tokens/s",
                "Tokens per second over the last log interval, summed over ranks.",
                "short",
                [(f"sum by (run_id) (lossguard_tokens_per_second{{{SEL}}})", by_run)],
                width=8,
            )
        )
        .with_panel(
            graph(
                "MFU and peak",
                "Model FLOPs utilisation (mean over ranks) and the dense peak it is taken "
                "against, labelled with where the peak came from (table, measured, config).",
                "percentunit",
                [
                    (f"avg by (run_id) (lossguard_mfu_ratio{{{SEL}}})", "{{run_id}} MFU"),
                    (
                        f"max by (run_id, source) (lossguard_peak_flops{{{SEL}}})",
                        "{{run_id}} peak ({{source}})",
                    ),
                ],
                UTIL_LOW_BAD,
                width=8,
            ).override_by_regexp(
                ".*peak.*",
                [
                    dm.DynamicConfigValue(id_val="unit", value="flops"),
                    dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                ],
            )
        )
        .with_panel(
            graph(
                "Step duration",
                "Step wall time quantiles from the histogram, per run.",
                "s",
                quantiles("lossguard_step_duration_seconds", "run_id", SEL, (0.5, 0.9, 0.99)),
                width=8,
            )
        )
        .with_row(db.Row("Memory and GPU"))
        .with_panel(
            graph(
                "Device memory",
                "Allocated, reserved and peak allocated device memory (host RSS on CPU), worst "
                "rank, against the device limit.",
                "bytes",
                [
                    (
                        f"max by (run_id, kind) (lossguard_device_memory_bytes{{{SEL}}})",
                        "{{run_id}} {{kind}}",
                    ),
                    (
                        f"max by (run_id) (lossguard_device_memory_limit_bytes{{{SEL}}})",
                        "{{run_id}} limit",
                    ),
                ],
            )
        )
        .with_panel(
            graph(
                "GPU utilisation",
                "NVML GPU utilisation per rank (absent where there is no GPU).",
                "percentunit",
                [(f"lossguard_gpu_utilization_ratio{{{SEL}}}", "{{run_id}} r{{rank}}")],
                UTIL_LOW_BAD,
                width=6,
                no_value=GPU_ONLY,
            )
        )
        .with_panel(
            graph(
                "GPU power and temperature",
                "NVML power draw (left) and temperature (right, from 80 °C hot) per rank.",
                "watt",
                [
                    (f"lossguard_gpu_power_watts{{{SEL}}}", "{{run_id}} r{{rank}} W"),
                    (f"lossguard_gpu_temperature_celsius{{{SEL}}}", "{{run_id}} r{{rank}} °C"),
                ],
                TEMPERATURE,
                width=6,
                no_value=GPU_ONLY,
            ).override_by_regexp(
                ".*°C$",
                [
                    dm.DynamicConfigValue(id_val="unit", value="celsius"),
                    dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                ],
            )
        )
        .with_row(db.Row("Checkpoints and actions"))
        .with_panel(
            graph(
                "Checkpoint steps",
                "Step of the latest, best (by validation loss) and last good checkpoint.",
                "none",
                [
                    (
                        f"max by (run_id, kind) (lossguard_checkpoint_step{{{SEL}}})",
                        "{{run_id}} {{kind}}",
                    )
                ],
                width=8,
            )
        )
        .with_panel(
            graph(
                "Checkpoint save duration",
                "Checkpoint save wall time quantiles from the histogram.",
                "s",
                quantiles("lossguard_checkpoint_save_duration_seconds", "run_id", SEL, (0.5, 0.99)),
                width=8,
            )
        )
        .with_panel(
            graph(
                "Rollbacks and control commands",
                "Rollbacks applied and control commands by command and result, per interval.",
                "short",
                [
                    (
                        f"max by (run_id) "
                        f"(increase(lossguard_rollbacks_total{{{SEL}}}[$__rate_interval]))",
                        "{{run_id}} rollbacks",
                    ),
                    (
                        f"max by (run_id, command, result) "
                        f"(increase(lossguard_control_commands_total{{{SEL}}}[$__rate_interval]))",
                        "{{run_id}} {{command}} {{result}}",
                    ),
                ],
                bars=True,
                width=8,
            )
        )
        .with_panel(
            graph(
                "Supervisor restarts and crashes",
                "Training command crashes and restarts (by reason) under lossguard-supervise.",
                "short",
                [
                    (
                        f"sum by (run_id) "
                        f"(increase(lossguard_supervisor_crashes_total{{{RUN}}}[$__rate_interval]))",
                        "{{run_id}} crashes",
                    ),
                    (
                        f"sum by (run_id, reason) "
                        f"(increase(lossguard_supervisor_restarts_total{{{RUN}}}"
                        f"[$__rate_interval]))",
                        "{{run_id}} restarts {{reason}}",
                    ),
                ],
                COUNT_BAD,
                bars=True,
                width=24,
            )
        )
    )
    return dcgm_row(board)
