"""What every dashboard is built from (grafana-foundation-sdk): the datasource variable, the
selectors, thresholds, panels (``graph``, ``single``), variables, annotations and the common
dashboard settings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
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
