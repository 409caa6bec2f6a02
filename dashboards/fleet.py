"""The fleet dashboard (``lossguard-fleet``)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import table
from grafana_foundation_sdk.models import dashboard as dm

from dashboards.panels import (
    COUNT_BAD,
    DATASOURCE,
    NEUTRAL,
    RUN_URL,
    UTIL_LOW_BAD,
    Steps,
    base,
    query,
    thresholds,
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
