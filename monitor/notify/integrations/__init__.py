"""Every receiver integration of the ``notifications`` section, ready to deliver: what the
delivery worker calls, one per lane (``receiver/kind[index]``)."""

from __future__ import annotations

from typing import Protocol

import requests

from lossguard.common.config import ConfigError
from lossguard.monitor.notify.config import (
    AlertmanagerConfig,
    LogConfig,
    NotificationsConfig,
    PagerDutyConfig,
    SlackConfig,
    WebhookConfig,
)
from lossguard.monitor.notify.integrations.alertmanager import AlertmanagerIntegration
from lossguard.monitor.notify.integrations.http import Outcome
from lossguard.monitor.notify.integrations.log import LogIntegration
from lossguard.monitor.notify.integrations.pagerduty import PagerDutyIntegration
from lossguard.monitor.notify.integrations.slack import SlackIntegration
from lossguard.monitor.notify.integrations.webhook import WebhookIntegration
from lossguard.monitor.notify.links import Links
from lossguard.monitor.notify.model import Notification, lane_name


class Integration(Protocol):
    kind: str  # "slack" | "pagerduty" | "webhook" | "log" | "alertmanager"
    send_resolved: bool
    pace_s: float  # least seconds between two requests to the same destination
    per_alert: bool  # one notification (outbox row) per alert

    def destination(self) -> str:
        """What the service keeps its pace by (a webhook URL, a routing key): lanes that share
        one share the pace."""
        ...

    def deliver(
        self,
        notification: Notification,
        notification_id: int,
        session: requests.Session,
        timeout_s: float,
    ) -> Outcome: ...


def build_integrations(
    config: NotificationsConfig, secrets: dict[str, str], external_url: str
) -> dict[str, Integration]:
    """Keyed by lane ``receiver/kind[index]`` (as ``Notification.lane``); ``secrets`` maps
    environment-variable names to values (``read_secrets``). A missing secret is a ConfigError
    naming the variable, never a value."""
    links = Links.from_config(config, external_url)
    built: dict[str, Integration] = {}
    for receiver in config.receivers:
        for kind, index, integration in receiver.integrations():
            lane = lane_name(receiver.name, kind, index)
            try:
                built[lane] = _build(integration, secrets, links)
            except KeyError as missing:
                raise ConfigError(
                    f"notifications: receiver {receiver.name!r} {kind}_configs.{index}: "
                    f"environment variable {missing.args[0]} is not set"
                ) from None
    return built


def _build(config: object, secrets: dict[str, str], links: Links) -> Integration:
    if isinstance(config, SlackConfig):
        return SlackIntegration(secrets[config.api_url_env], config.send_resolved, links)
    if isinstance(config, PagerDutyConfig):
        key = secrets[config.routing_key_env]
        return PagerDutyIntegration(config.url, key, config.send_resolved, links)
    if isinstance(config, WebhookConfig):
        url = secrets[config.url_env]
        return WebhookIntegration(url, config.send_resolved, config.max_alerts, links.monitor_url)
    if isinstance(config, LogConfig):
        return LogIntegration(config.send_resolved)
    if isinstance(config, AlertmanagerConfig):
        return AlertmanagerIntegration(
            config.url,
            config.send_resolved,
            username=config.username,
            password=None if config.password_env is None else secrets[config.password_env],
            generator_url=links.monitor_url,
        )
    raise TypeError(f"no integration for {type(config).__name__}")
