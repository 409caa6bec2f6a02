"""The ``notifications`` section: Alertmanager's shape validated at load, every problem one line
that names its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lossguard.common.config import ConfigError
from lossguard.monitor.config import load_monitor_config
from lossguard.monitor.notify.config import read_secrets

RECEIVERS = [
    {"name": "slack", "slack_configs": [{"api_url_env": "T_SLACK_URL"}]},
    {"name": "pager", "pagerduty_configs": [{"routing_key_env": "T_PD_KEY"}]},
]


def load(tmp_path: Path, notifications: dict[str, Any]) -> Any:
    path = tmp_path / "monitor.yml"
    settings = {
        "rules": {"files": ["rules.yml"]},
        "scrape": {"runs_root": "runs"},
        "notifications": notifications,
    }
    path.write_text(yaml.safe_dump(settings))
    return load_monitor_config(path)


def test_a_full_section_loads_with_alertmanager_names(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        {
            "receivers": RECEIVERS,
            "route": {
                "receiver": "slack",
                "group_by": ["alertname", "run_id"],
                "routes": [
                    {"receiver": "pager", "matchers": ['severity="critical"'], "continue": True}
                ],
            },
            "inhibit_rules": [
                {
                    "source_matchers": ["severity=critical"],
                    "target_matchers": ["severity=warning"],
                    "equal": ["run_id"],
                }
            ],
        },
    ).notifications
    assert config.route.routes[0].continue_ is True
    assert config.receivers[1].pagerduty_configs[0].url.endswith("/v2/enqueue")


def test_without_the_section_alerts_go_to_the_log(tmp_path: Path) -> None:
    config = load(tmp_path, {}).notifications
    assert config.route.receiver == "console"
    assert [(r.name, len(r.log_configs)) for r in config.receivers] == [("console", 1)]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"receivers": [{"name": "s", "slack_configs": [{"api_url": "http://x"}]}]},
            "notifications.receivers.0.slack_configs.0.api_url",
        ),
        (
            {"receivers": RECEIVERS, "route": {"receiver": "nobody"}},
            "notifications.route.receiver: no receiver named 'nobody' in receivers",
        ),
        (
            {"receivers": RECEIVERS + RECEIVERS[:1], "route": {"receiver": "slack"}},
            "notifications.receivers: receiver 'slack' is defined twice",
        ),
        (
            {"receivers": RECEIVERS, "route": {"receiver": "slack", "group_wait": "soon"}},
            "notifications.route.group_wait: not a valid duration: 'soon'",
        ),
        (
            {"receivers": RECEIVERS, "route": {"receiver": "slack", "matchers": ["a=b"]}},
            "notifications.route.matchers: the root route matches every alert",
        ),
        (
            {
                "receivers": RECEIVERS,
                "route": {"receiver": "slack", "routes": [{"matchers": ["sev=~(crit"]}]},
            },
            "bad matcher 'sev=~(crit'",
        ),
        (
            {"receivers": RECEIVERS, "route": {"receiver": "slack", "group_by": ["a", "..."]}},
            "notifications.route.group_by: '...' cannot be combined with label names",
        ),
        (
            {
                "receivers": [{"name": "s", "slack_configs": [{"api_url_env": "has space"}]}],
                "route": {"receiver": "s"},
            },
            "notifications.receivers.0.slack_configs.0.api_url_env",
        ),
    ],
)
def test_bad_sections_are_one_line_errors_naming_the_key(
    tmp_path: Path, section: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load(tmp_path, section)
    text = str(error.value)
    assert "\n" not in text and message in text, text


def test_secrets_are_read_from_the_environment_and_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load(tmp_path, {"receivers": RECEIVERS, "route": {"receiver": "slack"}})
    monkeypatch.setenv("T_SLACK_URL", "https://hooks.example/T/B/very-secret")
    monkeypatch.delenv("T_PD_KEY", raising=False)
    with pytest.raises(ConfigError) as error:
        read_secrets(config.notifications)
    assert str(error.value) == (
        "notifications.receivers.1.pagerduty_configs.0.routing_key_env: "
        "environment variable T_PD_KEY is not set"
    )
    monkeypatch.setenv("T_PD_KEY", "k" * 32)
    monkeypatch.setenv("T_SLACK_URL", "hooks.example/very-secret")
    with pytest.raises(ConfigError) as error:
        read_secrets(config.notifications)
    assert str(error.value) == (
        "notifications.receivers.0.slack_configs.0.api_url_env: "
        "environment variable T_SLACK_URL does not hold an http(s) URL"
    )
    monkeypatch.setenv("T_SLACK_URL", "https://hooks.example/T/B/very-secret")
    assert read_secrets(config.notifications) == {
        "T_SLACK_URL": "https://hooks.example/T/B/very-secret",
        "T_PD_KEY": "k" * 32,
    }
