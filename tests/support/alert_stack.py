"""The standard ops path from agents to the monitor, with the real Debian binaries: Prometheus
scraping agents and evaluating rule files, sending its alerts to Alertmanager, whose receiver
POSTs them to a webhook (the monitor's ``/api/v1/alertmanager``). For tests and benchmarks::

    with alert_stack(tmp / "stack", [agent_metrics_url], f"{monitor_url}/api/v1/alertmanager",
                     rule_files=[rules], token="s3cret") as stack:
        ...  # stack.prometheus.url, stack.alertmanager.url
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.amserver import AlertmanagerServer, alertmanager
from tests.support.promserver import PromServer, prometheus
from tests.support.webauth import WebAuth

MONITOR_WEBHOOK_PATH = "/api/v1/alertmanager"


@dataclass(frozen=True)
class AlertStack:
    prometheus: PromServer
    alertmanager: AlertmanagerServer


def webhook_receiver(
    name: str, url: str, *, credentials_file: Path | None = None, max_alerts: int = 0
) -> dict[str, Any]:
    """An Alertmanager receiver POSTing to ``url`` (firing and resolved), with a bearer token
    read from ``credentials_file`` when given."""
    webhook: dict[str, Any] = {"url": url, "send_resolved": True, "max_alerts": max_alerts}
    if credentials_file is not None:
        webhook["http_config"] = {
            "authorization": {"type": "Bearer", "credentials_file": str(credentials_file)}
        }
    return {"name": name, "webhook_configs": [webhook]}


def actions_config(
    webhook_url: str,
    *,
    credentials_file: Path | None = None,
    group_wait: str = "0s",
    group_interval: str = "1s",
    repeat_interval: str = "1h",
    also: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """An Alertmanager config whose every alert goes to ``webhook_url`` (grouped by alert, run
    and rank, sent at once), plus the webhook configs ``also`` in the same receiver (say a
    capture server, to see what the monitor was sent)."""
    receiver = webhook_receiver("monitor", webhook_url, credentials_file=credentials_file)
    receiver["webhook_configs"].extend(dict(extra) for extra in also)
    return {
        "route": {
            "receiver": "monitor",
            "group_by": ["alertname", "run_id", "rank"],
            "group_wait": group_wait,
            "group_interval": group_interval,
            "repeat_interval": repeat_interval,
        },
        "receivers": [receiver],
    }


@contextmanager
def alert_stack(
    directory: Path,
    metrics_urls: Sequence[str],
    webhook_url: str,
    *,
    rule_files: Sequence[Path],
    token: str | None = None,
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    group_wait: str = "0s",
    group_interval: str = "1s",
    repeat_interval: str = "1h",
    also: Sequence[Mapping[str, Any]] = (),
    target_labels: Mapping[str, Mapping[str, str]] | None = None,
    web_auth: WebAuth | None = None,
) -> Iterator[AlertStack]:
    """Alertmanager (see :func:`actions_config`; ``token`` goes into a credentials file of
    mode 0600) and Prometheus scraping ``metrics_urls`` and evaluating ``rule_files`` every
    ``evaluation_interval``, sending to that Alertmanager; both on free ports of 127.0.0.1 with
    their files under ``directory``, and, as in the compose stack, their web endpoints behind
    basic auth (``web_auth``, default a fresh password). Both are stopped on exit."""
    auth = web_auth or WebAuth()
    directory.mkdir(parents=True, exist_ok=True)
    credentials = None
    if token is not None:
        credentials = directory / "monitor-token"
        fd = os.open(credentials, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token)
    config = actions_config(
        webhook_url,
        credentials_file=credentials,
        group_wait=group_wait,
        group_interval=group_interval,
        repeat_interval=repeat_interval,
        also=also,
    )
    with (
        alertmanager(directory / "alertmanager", config, auth) as am,
        prometheus(
            directory / "prometheus",
            metrics_urls,
            scrape_interval=scrape_interval,
            evaluation_interval=evaluation_interval,
            rule_files=rule_files,
            target_labels=target_labels,
            alertmanagers=[am.url],
            web_auth=auth,
        ) as prom,
    ):
        yield AlertStack(prom, am)
