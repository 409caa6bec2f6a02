"""The monitor dashboard (``lossguard-monitor``)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from dashboards.panels import COUNT_BAD, base, graph, single


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
