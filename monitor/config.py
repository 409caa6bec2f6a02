"""``monitor.yml``: validated like the agent's config (pydantic, one-line errors that name the
key). Durations are Prometheus durations (``1s``, ``5m``, ``1h30m``), held as ``Duration``s;
relative paths are taken from the config file's folder, as Prometheus does for its rule files.
Validation reads neither the environment nor the user database: the tokens, secrets and
trusted owners are looked up at start (``webhook_token``, ``owner_ids``, ``read_secrets``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from lossguard.common.config import (
    ConfigError,
    Duration,
    LooseDuration,
    PositiveDuration,
    Section,
    field_error,
    read_config_file,
    validate,
)
from lossguard.common.control.protocol import MIN_TOKEN_LENGTH
from lossguard.common.ownership import user_ids
from lossguard.monitor.actions.policy import ActionsConfig
from lossguard.monitor.notify.config import NotificationsConfig
from lossguard.monitor.validation import http_url

DEFAULT_PORT = 9409


class ScrapeConfig(Section):
    interval: PositiveDuration = Field(
        default=Duration("1s"), description="How often every target is scraped."
    )
    timeout: PositiveDuration | None = Field(
        default=None, description="Per scrape; default: the interval, at most 10s."
    )
    job: str = Field(default="lossguard-agent", description="The `job` label of agent series.")
    targets: list[str] = Field(default_factory=list, description="Static agent /metrics URLs.")
    file_sd_files: list[str] = Field(
        default_factory=list,
        description="Prometheus file_sd JSON files (globs) whose targets are scraped too, "
        "re-read every scrape: the files a job writes on start and removes on exit "
        "(deploy/slurm/).",
    )
    runs_root: Path | None = Field(
        default=None, description="Discover agents from runs_root/*/agent.json."
    )
    forget_dead_runs_after: PositiveDuration = Field(
        default=Duration("24h"),
        description="Stop watching a run whose process died on this host this long after its "
        "last sign of life (its dead-run alert resolves).",
    )
    trusted_owners: list[str | int] = Field(
        default_factory=list,
        description="Users (names or uids) whose run directories, agent.json and "
        "supervisor.json under runs_root the monitor believes, besides its own user and root "
        "(docs/security.md); a run file writable by others is never believed.",
    )
    file_sd_path: Path | None = Field(
        default=None,
        description="Write the discovered targets (agents and live supervisors, with job, "
        "run_id and rank labels) to this Prometheus file_sd JSON file; needs runs_root.",
    )

    @field_validator("targets")
    @classmethod
    def _urls(cls, targets: list[str]) -> list[str]:
        for url in targets:
            http_url(url)
        return targets

    @model_validator(mode="after")
    def _timeout_within_interval(self) -> ScrapeConfig:
        if self.timeout is not None and self.timeout.seconds > self.interval.seconds:
            raise field_error("timeout", "must not exceed scrape.interval")
        if self.file_sd_path is not None and self.runs_root is None:
            raise field_error("file_sd_path", "needs scrape.runs_root")
        return self


class PrometheusConfig(Section):
    url: str = Field(description="Base URL of the Prometheus server, e.g. http://127.0.0.1:9090.")
    timeout: PositiveDuration = Duration("10s")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return http_url(url).rstrip("/")


class DiscoveryConfig(Section):
    forget: LooseDuration = Field(
        default=Duration("10m"),
        description="Keep a run's announced endpoints (lossguard_agent_info) this long after "
        "its series was last seen, then forget the run.",
    )


class RulesConfig(Section):
    files: list[Path] = Field(min_length=1, description="Prometheus-format rule files.")
    evaluation_interval: PositiveDuration = Duration("1s")
    external_labels: dict[str, str] = Field(default_factory=dict)
    external_url: str = ""


class StateConfig(Section):
    path: Path = Path("monitor-state/state.db")


class ListenConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    token_env: str = Field(
        default="LOSSGUARD_MONITOR_TOKEN",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding the bearer token that POST "
        "/api/v1/alertmanager and POST /api/v1/runs/{run_id}/control require; without it, "
        "both are off (on loopback too).",
    )


def owner_ids(scrape: ScrapeConfig) -> frozenset[int]:
    """The uids of ``scrape.trusted_owners``, looked up at start (ConfigError: no such user)."""
    try:
        return user_ids(scrape.trusted_owners)
    except ValueError as exc:
        raise ConfigError(f"scrape.trusted_owners: {exc}") from None


def webhook_token(listen: ListenConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """The bearer token of the endpoints that can make the monitor act (Alertmanager's
    webhook and control) from ``$listen.token_env``; None: not set, and both are off. One
    shorter than the agent's minimum (a placeholder such as ``REPLACE-ME``, a word) is a
    ConfigError: it would be guessed."""
    token = (os.environ if environ is None else environ).get(listen.token_env) or None
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"${listen.token_env} (listen.token_env): the token must be at least "
            f"{MIN_TOKEN_LENGTH} characters, not {len(token)} (make one with openssl rand -hex 32)"
        )
    return token


class MonitorConfig(Section):
    source: Literal["scrape", "prometheus"] = "scrape"
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    prometheus: PrometheusConfig | None = None
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    rules: RulesConfig
    state: StateConfig = Field(default_factory=StateConfig)
    listen: ListenConfig = Field(default_factory=ListenConfig)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    notifications: NotificationsConfig = Field(default_factory=NotificationsConfig)
    actions: ActionsConfig = Field(default_factory=ActionsConfig)
    _source_file: Path | None = PrivateAttr(default=None)

    @property
    def source_file(self) -> Path | None:
        """The file this was loaded from (None when built in code)."""
        return self._source_file

    @model_validator(mode="after")
    def _source_is_configured(self) -> MonitorConfig:
        if self.source == "prometheus" and self.prometheus is None:
            raise field_error("prometheus", "required when source is prometheus")
        scrape = self.scrape
        if self.source == "scrape" and not (
            scrape.targets or scrape.file_sd_files or scrape.runs_root is not None
        ):
            raise field_error("scrape", "give targets, file_sd_files or runs_root")
        return self


def load_monitor_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = ()
) -> MonitorConfig:
    """Read and validate ``monitor.yml``; relative paths are resolved against its folder."""
    config = validate(MonitorConfig, read_config_file(path), overrides)
    _check_notifications(config.notifications)
    base = Path(path).resolve().parent
    config.rules.files = [base / f for f in config.rules.files]
    config.state.path = base / config.state.path
    config._source_file = Path(path).resolve()
    if config.scrape.runs_root is not None:
        config.scrape.runs_root = base / config.scrape.runs_root
    if config.scrape.file_sd_path is not None:
        config.scrape.file_sd_path = base / config.scrape.file_sd_path
    return config


def _check_notifications(config: NotificationsConfig) -> None:
    """What the section's own validators cannot see: the routing tree and the inhibition
    rules as built (ConfigError naming the key)."""
    from lossguard.monitor.notify.inhibit import Inhibitor
    from lossguard.monitor.notify.routing import build_route

    try:
        build_route(config.route)
        Inhibitor(config.inhibit_rules)
    except ConfigError as exc:
        raise ConfigError(f"notifications.{exc}") from None
