"""The run dashboard's GPUs (DCGM) row: the selected runs' GPUs as NVIDIA's DCGM exporter
reports them (XID errors, power, temperature, tensor-core activity), joined to the runs by
``lossguard_gpu_info`` on ``Hostname`` and ``gpu``."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from dashboards.panels import COUNT_BAD, SEL, TEMPERATURE, graph, single

DCGM_EMPTY = (
    "DCGM is not scraped for these GPUs (no DCGM_FI_* series on the run's Hostname and gpu), "
    "or the run has no GPU"
)
GPU_JOIN = (
    "* on (Hostname, gpu) group_left (run_id, rank) "
    f"max by (Hostname, gpu, run_id, rank) (lossguard_gpu_info{{{SEL}}})"
)
"""Puts a DCGM series beside the run and rank whose ``lossguard_gpu_info`` names its GPU."""
DCGM_LEGEND = "{{run_id}} r{{rank}} {{Hostname}} GPU {{gpu}}"


def dcgm(metric: str) -> str:
    """``metric`` of DCGM's exporter on the selected runs' GPUs, labelled with run and rank."""
    return f"{metric} {GPU_JOIN}"


def dcgm_row(dashboard: db.Dashboard) -> db.Dashboard:
    """``dashboard`` with the GPUs (DCGM) row appended: the run's GPUs as NVIDIA's DCGM exporter
    sees them, joined on host name and GPU index; each panel says so when DCGM is not scraped."""
    panels: list[Builder[dm.Panel]] = [
        single(
            "GPUs seen by DCGM",
            "The selected runs' GPUs (lossguard_gpu_info) that the DCGM exporter reports on.",
            "none",
            [(f"count({dcgm('DCGM_FI_DEV_GPU_TEMP')})", "GPUs")],
            width=4,
        )
        .no_value(DCGM_EMPTY)
        .graph_mode(cm.BigValueGraphMode.NONE),
        graph(
            "XID errors (DCGM)",
            "The last XID error code DCGM saw on each GPU (0: none); see the GPUXidError runbook.",
            "none",
            [(dcgm("DCGM_FI_DEV_XID_ERRORS"), DCGM_LEGEND)],
            COUNT_BAD,
            width=20,
            no_value=DCGM_EMPTY,
        ),
        graph(
            "GPU power (DCGM)",
            "Power draw of each GPU, from DCGM.",
            "watt",
            [(dcgm("DCGM_FI_DEV_POWER_USAGE"), DCGM_LEGEND)],
            width=8,
            no_value=DCGM_EMPTY,
        ),
        graph(
            "GPU temperature (DCGM)",
            "Temperature of each GPU, from DCGM (hot from 80 °C).",
            "celsius",
            [(dcgm("DCGM_FI_DEV_GPU_TEMP"), DCGM_LEGEND)],
            TEMPERATURE,
            width=8,
            no_value=DCGM_EMPTY,
        ),
        graph(
            "Tensor core activity (DCGM)",
            "Fraction of cycles the tensor cores were active, per GPU (DCGM profiling field).",
            "percentunit",
            [(dcgm("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"), DCGM_LEGEND)],
            width=8,
            no_value=DCGM_EMPTY,
        ),
    ]
    dashboard.with_row(db.Row("GPUs (DCGM)"))
    for panel in panels:
        dashboard.with_panel(panel)
    return dashboard
