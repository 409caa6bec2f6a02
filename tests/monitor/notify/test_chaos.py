"""Chaos: Slack and PagerDuty fail half of all requests (500, 503, 429 with Retry-After,
dropped connections) while the monitor is SIGKILLed and restarted again and again. At the end
every notification was delivered, each exactly once: the only repeat allowed is a Slack message
whose delivery a kill interrupted after Slack had taken it and before the monitor recorded
the 200 (no receiver can tell a retry from a new message there); PagerDuty folds even those
into the one incident by its dedup_key."""

from __future__ import annotations

import random
import signal
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_receivers import FakePagerDuty, FakeSlack, FaultSpec
from tests.support.processes import start_monitor, stop_process, wait_for
from tests.support.promserver import exposition_server
from tests.support.runs import alert_events, write_monitor_config

pytestmark = pytest.mark.live

ALERTS = 4
KILLS = 4
FAULTS: list[FaultSpec] = [500, 503, (429, 1), "drop"]
RULES = """
groups:
  - name: chaos
    rules:
      - alert: Chaos
        expr: chaos_alert > 0
        labels: {severity: critical}
        annotations: {summary: "chaos {{ $labels.id }}"}
"""


def exposition(firing: bool) -> str:
    value = 1 if firing else 0
    lines = [f'chaos_alert{{id="{i}"}} {value}' for i in range(ALERTS)]
    return "# TYPE chaos_alert gauge\n" + "\n".join(lines) + "\n"


class Killer:
    """SIGKILLs the monitor at random moments and starts it again, ``KILLS`` times."""

    def __init__(self, config: Path, env: dict[str, str], seed: int) -> None:
        self.config, self.env = config, env
        self.rng = random.Random(seed)
        self.process = start_monitor(config, env=env)
        self.kills: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while len(self.kills) < KILLS and not self._done.wait(self.rng.uniform(1.0, 3.0)):
            self.kills.append(time.time())
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = start_monitor(self.config, env=self.env)

    def finish(self) -> None:
        self._thread.join(timeout=60)
        assert len(self.kills) == KILLS


def outbox(db: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            return dict(conn.execute("SELECT state, COUNT(*) FROM outbox GROUP BY state"))
        except sqlite3.OperationalError:
            return {}


def slack_statuses(slack: FakeSlack) -> Counter[tuple[str, str]]:
    """(alert id, FIRING|RESOLVED) of every accepted Slack message."""
    seen: Counter[tuple[str, str]] = Counter()
    for message in slack.messages:
        text: str = message.body["text"]
        status = "FIRING" if text.startswith("[FIRING") else "RESOLVED"
        seen[(text.rsplit("chaos ", 1)[1], status)] += 1
    return seen


def interrupted_by_a_kill(slack: FakeSlack, notification_id: int, kills: list[float]) -> bool:
    """Whether a kill fell between Slack taking this message the first time and shortly after
    its 200 went out (the monitor records it within milliseconds; 2 s allows for a loaded
    machine): the one window in which a repeat is expected."""
    first = next(m for m in slack.messages if m.notification_id == notification_id)
    exchange = next(x for x in slack.exchanges if x.arrived_at == first.received_at)
    end = (exchange.replied_at or first.received_at) + 2.0
    return any(first.received_at - 0.01 <= k <= end for k in kills)


def test_every_notification_arrives_exactly_once_through_failures_and_kills(
    tmp_path: Path,
) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES)
    with (
        FakeSlack() as slack,
        FakePagerDuty() as pager,
        exposition_server(exposition(False)) as target,
    ):
        settings: dict[str, Any] = {
            "receivers": [
                {"name": "slack", "slack_configs": [{"api_url_env": "LG_CHAOS_SLACK"}]},
                {
                    "name": "pager",
                    "pagerduty_configs": [
                        {"routing_key_env": "LG_CHAOS_PD", "url": pager.enqueue_url}
                    ],
                },
            ],
            "route": {
                "receiver": "slack",
                "group_by": ["alertname", "id"],
                "group_wait": "0s",
                "group_interval": "1s",
                "routes": [
                    {"receiver": "pager", "matchers": ["severity=critical"], "continue": True},
                    {"receiver": "slack", "matchers": ["severity=critical"]},
                ],
            },
            "delivery": {"timeout": "2s", "min_backoff": "100ms", "max_backoff": "500ms"},
        }
        config, _ = write_monitor_config(
            tmp_path / "monitor.yml",
            [rules],
            scrape={"targets": [target.url]},
            notifications=settings,
        )
        db = tmp_path / "state.db"
        for service in (slack, pager):
            service.fail_ratio(0.5, seed=7, faults=FAULTS)
        env = {"LG_CHAOS_SLACK": slack.webhook_url, "LG_CHAOS_PD": pager.routing_key}
        killer = Killer(config, env, seed=11)
        try:
            target.body = exposition(True)
            wait_for(
                lambda: (
                    len(pager.incidents) == ALERTS
                    and sum(s == "FIRING" for _, s in slack_statuses(slack)) == ALERTS
                ),
                120,
                "every alert paged",
            )
            target.body = exposition(False)
            wait_for(
                lambda: sum(e["kind"] == "resolved" for e in alert_events(db)) == ALERTS,
                60,
                "every alert resolved",
            )
            killer.finish()
            wait_for(
                lambda: "pending" not in outbox(db) and not pager.open_incidents(),
                120,
                "the outbox drained",
            )
        finally:
            assert stop_process(killer.process) == 0
        assert outbox(db) == {"delivered": 2 * ALERTS + 2 * ALERTS}  # no dead letters
        failures = [
            x for x in slack.exchanges + pager.exchanges if x.status != 202 and x.status != 200
        ]
        assert len(failures) >= ALERTS  # the chaos was real

        # PagerDuty: one incident per group (one alert each here), opened once and resolved
        incidents = pager.incidents
        assert len({i.dedup_key for i in incidents}) == len(incidents) == ALERTS
        assert all(i.resolved_at is not None for i in incidents)

        # Slack: each alert's firing and resolved message, once, but for kill-interrupted ones
        ids = Counter(slack.accepted_ids())
        assert None not in ids and len(ids) == 2 * ALERTS
        repeated = [i for i, n in ids.items() if n > 1]
        for notification_id in repeated:
            assert isinstance(notification_id, int)
            assert interrupted_by_a_kill(slack, notification_id, killer.kills), (
                f"Slack got notification #{notification_id} twice with no kill around it"
            )
        statuses = slack_statuses(slack)
        assert set(statuses) == {(str(i), s) for i in range(ALERTS) for s in ("FIRING", "RESOLVED")}
        assert sum(statuses.values()) == 2 * ALERTS + sum(ids[i] - 1 for i in repeated)
        events = Counter((e["fingerprint"], e["kind"]) for e in alert_events(db))
        assert all(n == 1 for n in events.values())  # no transition recorded twice
