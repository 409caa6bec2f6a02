"""lossguard's Grafana dashboards as code (grafana-foundation-sdk): ``python -m dashboards.build``
writes ``dashboards/json/<uid>.json`` for the run, fleet and monitor dashboards. Every query reads
a Prometheus datasource variable, ``${datasource}``, that provisioning binds; every metric name is
one of the catalogues' (common/catalogue.py, monitor/metrics.py, monitor/supervisor/metrics.py),
which tests/test_dashboards.py checks, along with the committed JSON being current."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

JSON_DIR = Path(__file__).resolve().parent / "json"
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run_id=~"$run_id"'
SEL = 'run_id=~"$run_id", rank=~"$rank"'
RUN_URL = "/d/lossguard-run?var-run_id=${__data.fields.run_id}"
Steps = Sequence[tuple[float | None, str]]

# Threshold steps: (from value, colour); the first starts at -Infinity (None).
NEUTRAL: Steps = [(None, "green")]
# what an empty panel that only some runs fill says instead of "No data"
FP8_ONLY = "No FP8 run selected (precision.dtype: fp8)"
FIDELITY_ONLY = "No FP8 run with the fidelity check selected (telemetry.fp8_fidelity)"
FP16_ONLY = "No fp16 run selected (precision.dtype: fp16)"
GPU_ONLY = "No GPU: NVML metrics come from CUDA runs"
COUNT_BAD: Steps = [(None, "green"), (1, "red")]
ZSCORE: Steps = [(None, "green"), (3, "yellow"), (6, "red")]  # agent default spike k = 6
FRACTION_HIGH_BAD: Steps = [(None, "green"), (0.85, "yellow"), (0.95, "red")]
FP8_RATIO: Steps = [(None, "green"), (0.001, "yellow"), (0.01, "red")]
FIDELITY: Steps = [(None, "red"), (0.9, "yellow"), (0.99, "green")]  # FP8FidelityLow: < 0.9
UTIL_LOW_BAD: Steps = [(None, "red"), (0.3, "yellow"), (0.6, "green")]
TEMPERATURE: Steps = [(None, "green"), (80, "yellow"), (90, "red")]


def thresholds(steps: Steps) -> db.ThresholdsConfig:
    """Absolute thresholds from (value, colour) pairs."""
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=value, color=color) for value, color in steps])
    )


def query(
    expr: str, legend: str = "", ref: str = "A", instant: bool = False
) -> prometheus.Dataquery:
    """A PromQL target on the datasource variable."""
    target = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DATASOURCE)
    target = target.legend_format(legend) if legend else target
    if instant:
        return target.instant().format(pm.PromQueryFormat.TABLE)
    return target.range()


def targets(queries: Sequence[tuple[str, str]]) -> list[prometheus.Dataquery]:
    """(expr, legend) pairs as targets A, B, C, ..."""
    return [query(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def graph(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[tuple[str, str]],
    steps: Steps = NEUTRAL,
    width: int = 12,
    bars: bool = False,
    no_value: str | None = None,
) -> timeseries.Panel:
    """A time series panel; threshold lines are drawn when there is more than one step;
    ``no_value`` says why a panel that only some runs fill is empty."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .targets(list(targets(queries)))
        .thresholds(thresholds(steps))
        .height(8)
        .span(width)
        .legend(cb.VizLegendOptions().show_legend(True).display_mode(cm.LegendDisplayMode.LIST))
        .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI))
    )
    if len(steps) > 1:
        panel = panel.thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.LINE)
        )
    if bars:
        panel = panel.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80)
    if no_value:
        panel = panel.no_value(no_value)
    return panel


def single(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[tuple[str, str]],
    steps: Steps = NEUTRAL,
    width: int = 3,
) -> stat.Panel:
    """A stat panel showing the last value of each series."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .targets(list(targets(queries)))
        .thresholds(thresholds(steps))
        .height(4)
        .span(width)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .color_mode(cm.BigValueColorMode.VALUE)
        .graph_mode(cm.BigValueGraphMode.AREA)
    )


def quantiles(metric: str, by: str, selector: str, qs: Sequence[float]) -> list[tuple[str, str]]:
    """histogram_quantile queries of ``metric``'s buckets, per ``by``."""
    return [
        (
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))",
            f"{{{{{by}}}}} p{round(q * 100)}",
        )
        for q in qs
    ]


def datasource_variable() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Datasource").type("prometheus")


def query_variable(name: str, label: str, expr: str) -> db.QueryVariable:
    """A multi-select label_values variable with All."""
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(expr)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
    )


def annotation(name: str, expr: str, color: str) -> db.AnnotationQuery:
    return (
        db.AnnotationQuery()
        .name(name)
        .datasource(DATASOURCE)
        .expr(expr)
        .icon_color(color)
        .enable(True)
    )


def base(uid: str, title: str, description: str) -> db.Dashboard:
    """A dashboard with the common settings and the datasource variable."""
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["lossguard"])
        .time("now-6h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource_variable())
    )


def run_dashboard() -> db.Dashboard:
    """One or more runs (run_id and rank variables): overview, stability, throughput, memory and
    GPU, checkpoints and actions; spikes, rollbacks and firing alerts as annotations."""
    by_run = "{{run_id}}"
    return (
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
        .with_row(db.Row("Stability"))
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


def fleet_dashboard() -> db.Dashboard:
    """Every run in one table, each row linking to its run dashboard."""
    columns: list[tuple[str, str, str, Steps | None]] = [
        ("max by (run_id) (lossguard_step)", "step", "none", None),
        (
            "max by (run_id) (lossguard_step) / max by (run_id) (lossguard_step_target)",
            "progress",
            "percentunit",
            None,
        ),
        ("avg by (run_id) (lossguard_train_loss)", "train loss", "none", None),
        ("avg by (run_id) (lossguard_mfu_ratio)", "MFU", "percentunit", UTIL_LOW_BAD),
        ("sum by (run_id) (lossguard_tokens_per_second)", "tokens/s", "short", None),
        (
            "time() - max by (run_id) (lossguard_last_step_timestamp_seconds)",
            "since last step",
            "s",
            [(None, "green"), (300, "yellow"), (900, "red")],
        ),
        (
            'count by (run_id) (ALERTS{alertstate="firing", run_id!=""})'
            " or 0 * max by (run_id) (lossguard_step)",
            "firing alerts",
            "none",
            COUNT_BAD,
        ),
    ]
    refs = [chr(ord("A") + i) for i in range(len(columns))]
    panel = (
        table.Panel()
        .title("Runs")
        .description(
            "Every run lossguard's agents export, one row each; click a row for its run "
            "dashboard. 'since last step' is the heartbeat's age (a stalled or dead run)."
        )
        .unit("none")
        .datasource(DATASOURCE)
        .targets(
            [
                query(column[0], "", ref, instant=True)
                for column, ref in zip(columns, refs, strict=True)
            ]
        )
        .thresholds(thresholds(NEUTRAL))
        .height(16)
        .span(24)
        .data_links([db.DashboardLink("Run dashboard").url(RUN_URL)])
        .transformations(
            [
                dm.DataTransformerConfig(id_val="merge", options={}),
                dm.DataTransformerConfig(
                    id_val="organize",
                    options={
                        "excludeByName": {"Time": True},
                        "renameByName": {
                            f"Value #{ref}": column[1]
                            for column, ref in zip(columns, refs, strict=True)
                        },
                    },
                ),
            ]
        )
        .sort_by([cb.TableSortByFieldState().display_name("run_id")])
    )
    for _, name, unit, steps in columns:
        properties = [dm.DynamicConfigValue(id_val="unit", value=unit)]
        if steps is not None:
            properties += [
                dm.DynamicConfigValue(id_val="thresholds", value=thresholds(steps).build()),
                dm.DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-text"}),
            ]
        panel = panel.override_by_name(name, properties)
    return base(
        "lossguard-fleet", "lossguard fleet", "Every lossguard run at a glance."
    ).with_panel(panel)


def monitor_dashboard() -> db.Dashboard:
    """lossguard-monitor itself: targets, rule evaluation, notifications, outbox, actions."""
    rate = "[$__rate_interval]"
    return (
        base("lossguard-monitor", "lossguard monitor", "lossguard-monitor's own health.")
        .with_row(db.Row("Targets and rules"))
        .with_panel(
            single(
                "Targets down",
                "Scrape targets whose last scrape failed (lossguard_monitor_target_up == 0).",
                "none",
                [("count(lossguard_monitor_target_up == 0) or vector(0)", "down")],
                COUNT_BAD,
                width=4,
            )
        )
        .with_panel(
            single(
                "Outbox pending",
                "Notifications waiting for delivery.",
                "none",
                [("sum(lossguard_monitor_outbox_pending)", "pending")],
                [(None, "green"), (10, "yellow"), (100, "red")],
                width=4,
            )
        )
        .with_panel(
            single(
                "Dead letters",
                "Notifications that failed for good (lossguard-monitor status lists them).",
                "none",
                [("sum(lossguard_monitor_outbox_dead_letters)", "dead")],
                COUNT_BAD,
                width=4,
            )
        )
        .with_panel(
            single(
                "Rules loaded",
                "Alerting rules currently loaded (lossguard_monitor_rules_loaded).",
                "none",
                [("sum(lossguard_monitor_rules_loaded)", "rules")],
                width=4,
            )
        )
        .with_panel(
            single(
                "Last reload",
                "1 if the last rules (re)load succeeded.",
                "bool_yes_no",
                [("min(lossguard_monitor_config_last_reload_successful)", "ok")],
                [(None, "red"), (1, "green")],
                width=4,
            )
        )
        .with_panel(
            single(
                "Firing (monitor)",
                "Alerts firing in the monitor's own rule evaluation.",
                "none",
                [('sum(lossguard_monitor_alerts{state="firing"})', "firing")],
                COUNT_BAD,
                width=4,
            )
        )
        .with_panel(
            graph(
                "Targets up",
                "1 if the last scrape of the target succeeded, per target.",
                "bool_yes_no",
                [("lossguard_monitor_target_up", "{{target}}")],
                [(None, "red"), (1, "green")],
            )
        )
        .with_panel(
            graph(
                "Rule evaluation duration",
                "Wall time of one rule's evaluation, quantiles from the histogram, and failures.",
                "s",
                [
                    (
                        f"histogram_quantile({q}, sum by (le) "
                        f"(rate(lossguard_monitor_rule_evaluation_duration_seconds_bucket{rate})))",
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.99)
                ]
                + [
                    (
                        "sum by (alertname) "
                        f"(increase(lossguard_monitor_rule_evaluation_failures_total{rate}))",
                        "failures {{alertname}}",
                    )
                ],
                [(None, "green"), (1, "red")],
            ).override_by_regexp(
                "failures.*", [dm.DynamicConfigValue(id_val="unit", value="short")]
            )
        )
        .with_row(db.Row("Notifications and actions"))
        .with_panel(
            graph(
                "Notifications by result",
                "Delivery attempts per interval by receiver and result: delivered, retry, dead.",
                "short",
                [
                    (
                        "sum by (receiver, result) "
                        f"(increase(lossguard_monitor_notifications_total{rate}))",
                        "{{receiver}} {{result}}",
                    )
                ],
                bars=True,
                width=8,
            )
        )
        .with_panel(
            graph(
                "Outbox",
                "Notifications waiting for delivery and dead letters.",
                "short",
                [
                    ("sum(lossguard_monitor_outbox_pending)", "pending"),
                    ("sum(lossguard_monitor_outbox_dead_letters)", "dead letters"),
                ],
                COUNT_BAD,
                width=8,
            )
        )
        .with_panel(
            graph(
                "Actions by action and result",
                "Actions per interval: applied, failed, retry, held (by a silence), dry_run.",
                "short",
                [
                    (
                        "sum by (action, result) "
                        f"(increase(lossguard_monitor_actions_total{rate}))",
                        "{{action}} {{result}}",
                    )
                ],
                bars=True,
                width=8,
            )
        )
    )


DASHBOARDS = {
    "lossguard-run": run_dashboard,
    "lossguard-fleet": fleet_dashboard,
    "lossguard-monitor": monitor_dashboard,
}


def render(builder: db.Dashboard) -> str:
    """The dashboard's JSON, panels numbered in order, keys sorted: stable across runs."""
    model = builder.build()
    for number, panel in enumerate(model.panels or [], start=1):
        panel.id_val = number
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(directory: Path = JSON_DIR) -> list[Path]:
    """Write every dashboard as ``<uid>.json`` under ``directory``; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid, make in DASHBOARDS.items():
        path = directory / f"{uid}.json"
        path.write_text(render(make()), encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=JSON_DIR, help="directory (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(path)


if __name__ == "__main__":
    main()
