"""The ``notifications`` section of monitor.yml, shaped like Alertmanager's configuration:
receivers with ``slack_configs``, ``pagerduty_configs``, ``webhook_configs``, ``log_configs``
and ``alertmanager_configs`` (the monitor's own alerts handed to an Alertmanager),
a routing tree, inhibition rules. Secrets are never in the file: each URL or key is read from
the environment variable the file names (``*_env``)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, field_validator, model_validator

from lossguard.common.config import ConfigError, Duration, Section, field_error
from lossguard.monitor.notify.matchers import parse_matchers
from lossguard.monitor.validation import http_url

PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class _Integration(Section):
    send_resolved: bool = Field(default=True, description="Also tell this receiver of resolved.")


class SlackConfig(_Integration):
    api_url_env: str = Field(
        pattern=ENV_NAME, description="Environment variable holding the incoming-webhook URL."
    )


class PagerDutyConfig(_Integration):
    routing_key_env: str = Field(
        pattern=ENV_NAME, description="Environment variable holding the Events API v2 key."
    )
    url: str = Field(default=PAGERDUTY_EVENTS_URL, description="Events API v2 endpoint.")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return http_url(url)


class WebhookConfig(_Integration):
    url_env: str = Field(pattern=ENV_NAME, description="Environment variable holding the URL.")
    max_alerts: int = Field(default=0, ge=0, description="Alerts per message; 0 = all.")


class AlertmanagerConfig(_Integration):
    """The monitor's own alerts posted to an Alertmanager, which routes them on."""

    url: str = Field(description="Alertmanager's base URL, e.g. http://alertmanager:9093.")
    username: str = Field(default="", description="Basic-auth user (with password_env).")
    password_env: str | None = Field(
        default=None, pattern=ENV_NAME, description="Environment variable holding the password."
    )

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return http_url(url)


class LogConfig(_Integration):
    """Notifications written to the monitor's log (the console)."""


class ReceiverConfig(Section):
    name: str = Field(min_length=1)
    slack_configs: list[SlackConfig] = Field(default_factory=list)
    pagerduty_configs: list[PagerDutyConfig] = Field(default_factory=list)
    webhook_configs: list[WebhookConfig] = Field(default_factory=list)
    log_configs: list[LogConfig] = Field(default_factory=list)
    alertmanager_configs: list[AlertmanagerConfig] = Field(default_factory=list)

    def integrations(self) -> list[tuple[str, int, _Integration]]:
        """(kind, index, config) of every integration of this receiver."""
        kinds: list[tuple[str, list[Any]]] = [
            ("slack", self.slack_configs),
            ("pagerduty", self.pagerduty_configs),
            ("webhook", self.webhook_configs),
            ("log", self.log_configs),
            ("alertmanager", self.alertmanager_configs),
        ]
        return [(kind, i, c) for kind, configs in kinds for i, c in enumerate(configs)]


class RouteConfig(Section):
    """A node of the routing tree; unset fields are inherited from the parent route."""

    receiver: str | None = None
    matchers: list[str] = Field(default_factory=list, description='e.g. severity="critical"')
    group_by: list[str] | None = Field(default=None, description="'...' groups by all labels.")
    group_wait: Duration | None = None
    group_interval: Duration | None = None
    repeat_interval: Duration | None = None
    continue_: bool = Field(default=False, alias="continue")
    routes: list[RouteConfig] = Field(default_factory=list)

    @field_validator("matchers")
    @classmethod
    def _matchers(cls, matchers: list[str]) -> list[str]:
        parse_matchers(matchers)
        return matchers


class InhibitRuleConfig(Section):
    """While an alert matching ``source_matchers`` fires, alerts matching ``target_matchers``
    with the same values of the ``equal`` labels are not sent."""

    source_matchers: list[str] = Field(min_length=1)
    target_matchers: list[str] = Field(min_length=1)
    equal: list[str] = Field(default_factory=list)

    @field_validator("source_matchers", "target_matchers")
    @classmethod
    def _matchers(cls, matchers: list[str]) -> list[str]:
        parse_matchers(matchers)
        return matchers


class DeliveryConfig(Section):
    timeout: Duration = Field(default=Duration("10s"), description="Per HTTP request.")
    min_backoff: Duration = Field(
        default=Duration("1s"), description="First retry delay (then doubled)."
    )
    max_backoff: Duration = Field(default=Duration("5m"), description="Longest retry delay.")


def _default_receivers() -> list[ReceiverConfig]:
    return [ReceiverConfig(name="console", log_configs=[LogConfig()])]


class NotificationsConfig(Section):
    dashboard_url: str = Field(
        default="",
        description="Link to a run's dashboard; {run_id} (or any label name) is filled in.",
    )
    runbook_base_url: str = Field(
        default="", description="Base that relative runbook_url annotations are resolved against."
    )
    receivers: list[ReceiverConfig] = Field(default_factory=_default_receivers)
    route: RouteConfig = Field(default_factory=lambda: RouteConfig(receiver="console"))
    inhibit_rules: list[InhibitRuleConfig] = Field(default_factory=list)
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)

    @model_validator(mode="after")
    def _receivers_exist(self) -> NotificationsConfig:
        names = [r.name for r in self.receivers]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise field_error("receivers", f"receiver {duplicated[0]!r} is defined twice")
        if self.route.receiver is None:
            raise field_error("route.receiver", "the root route needs a receiver")
        if self.route.matchers:
            raise field_error("route.matchers", "the root route matches every alert")
        for path, route in _walk(self.route, "route"):
            if route.receiver is not None and route.receiver not in names:
                raise field_error(
                    f"{path}.receiver", f"no receiver named {route.receiver!r} in receivers"
                )
        return self


def _walk(route: RouteConfig, path: str) -> list[tuple[str, RouteConfig]]:
    found = [(path, route)]
    for i, child in enumerate(route.routes):
        found += _walk(child, f"{path}.routes.{i}")
    return found


def read_secrets(config: NotificationsConfig) -> dict[str, str]:
    """The value of every environment variable the receivers name (ConfigError naming the key
    of the first one that is unset or empty). The values are never logged."""
    secrets: dict[str, str] = {}
    for r, receiver in enumerate(config.receivers):
        for kind, index, integration in receiver.integrations():
            for key, env in _env_names(integration):
                value = os.environ.get(env, "")
                where = f"notifications.receivers.{r}.{kind}_configs.{index}.{key}"
                if not value:
                    raise ConfigError(f"{where}: environment variable {env} is not set")
                if key.endswith("url_env") and not _is_http_url(value):
                    raise ConfigError(  # the value is a secret: not shown
                        f"{where}: environment variable {env} does not hold an http(s) URL"
                    )
                secrets[env] = value
    return secrets


def _is_http_url(value: str) -> bool:
    try:
        http_url(value)
    except ValueError:
        return False
    return True


def _env_names(integration: _Integration) -> list[tuple[str, str]]:
    return [
        (key, value)
        for key, value in integration.model_dump().items()
        if key.endswith("_env") and isinstance(value, str)
    ]
