"""``lossguard-monitor silence add|list|expire``, ``outbox retry|drop`` and ``status`` on a
state database, as an operator uses them (the dispatcher's tests show what a silence mutes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lossguard.monitor.alert_store import AlertStore
from lossguard.monitor.notify.model import AlertInfo, Notification
from lossguard.monitor.notify.store import DEAD, PENDING, NotifyStore
from tests.support.processes import REPO, monitor_cli
from tests.support.runs import write_monitor_config

pytestmark = pytest.mark.live

RULES = REPO / "alerts" / "lossguard.rules.yml"


def test_silences_are_added_listed_expired_and_shown_in_the_status(tmp_path: Path) -> None:
    config, _ = write_monitor_config(tmp_path / "monitor.yml", [RULES], scrape={"runs_root": "r"})
    c = str(config)
    added = monitor_cli(
        "silence", "add", "--config", c, "alertname=LossSpike", 'run_id=~"exp-.*"',
        "--duration", "2h", "--author", "ana", "--comment", "lr sweep, spikes expected",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    silence_id = added.stdout.strip()
    assert re.fullmatch(r"[0-9a-f-]{36}", silence_id)

    listed = monitor_cli("silence", "list", "--config", c)
    header, row = listed.stdout.strip().splitlines()
    assert header.split()[:2] == ["ID", "MATCHERS"]
    assert row.startswith(silence_id)
    assert 'alertname="LossSpike" run_id=~"exp-.*"' in row
    assert row.split()[-5:] == ["ana", "lr", "sweep,", "spikes", "expected"]

    status = monitor_cli("status", "--config", c)
    assert status.returncode == 1  # no daemon answers
    assert "not reachable" in status.stdout
    assert (
        f"silences (1)\n  {silence_id}  " in status.stdout
        and "active, ends in 1h59m" in status.stdout
    )
    assert "outbox: 0 pending, 0 delivered, 0 dead" in status.stdout

    assert monitor_cli("silence", "expire", "--config", c, silence_id).returncode == 0
    assert len(monitor_cli("silence", "list", "--config", c).stdout.strip().splitlines()) == 1
    expired = monitor_cli("silence", "list", "--config", c, "--expired").stdout
    assert silence_id in expired


def test_bad_silences_get_a_one_line_error_and_exit_2(tmp_path: Path) -> None:
    config, _ = write_monitor_config(tmp_path / "monitor.yml", [RULES], scrape={"runs_root": "r"})
    c = str(config)
    cases = {
        ("add", "1abc=x"): "bad matcher '1abc=x'",
        ("add", 'run_id=~"("'): "invalid regex '('",
        ("add", 'job=~""'): "matchers must not all match the empty label set",
        ("add", "a=b", "--duration", "soon"): "--duration: not a valid duration: 'soon'",
        ("expire", "no-such-id"): "no silence with id 'no-such-id'",
        ("add", "a=b", "--start", "nan"): "argument --start: not a Unix time in seconds: 'nan'",
    }
    for args, message in cases.items():
        extra = ("--comment", "c") if args[0] == "add" else ()
        result = monitor_cli("silence", *args, "--config", c, *extra)
        assert result.returncode == 2, args
        line = result.stderr.strip().splitlines()[-1]  # argparse prints its usage first
        assert line.startswith("lossguard-monitor") and "error: " in line, line
        assert message in line, line
    missing = monitor_cli("status", "--config", str(tmp_path / "nowhere" / "monitor.yml"))
    assert missing.returncode == 2 and missing.stderr.endswith("monitor.yml: no such config file\n")
    other = tmp_path / "other.yml"
    other.write_text(config.read_text().replace(str(tmp_path / "state.db"), "elsewhere/s.db"))
    no_db = monitor_cli("status", "--config", str(other))
    assert no_db.returncode == 2
    assert no_db.stderr.strip().endswith("/elsewhere/s.db; has the monitor run?")
    assert not (tmp_path / "elsewhere").exists()


def test_dead_letters_can_be_sent_again_or_dropped(tmp_path: Path) -> None:
    config, _ = write_monitor_config(tmp_path / "monitor.yml", [RULES], scrape={"runs_root": "r"})
    state = AlertStore(tmp_path / "state.db")
    store = NotifyStore(state)
    ids = []
    for name in ("A", "B"):
        alert = AlertInfo("f" * 16, "firing", {"alertname": name}, {}, 1.0, 0.0)
        note = Notification("team", "slack", 0, "{}:{}", {}, (alert,), 0.0)
        with state.transaction() as db:
            ids.append(NotifyStore.queue(db, note))
        store.failed(ids[-1], "HTTP 410 channel_is_archived", None, 1.0)
    status = monitor_cli("status", "--config", str(config)).stdout
    assert f"dead letters (2)\n  #{ids[1]}  team/slack[0]  firing B" in status
    assert "HTTP 410 channel_is_archived" in status

    retried = monitor_cli("outbox", "retry", str(ids[0]), "--config", str(config))
    assert retried.returncode == 0
    (requeued,) = store.entries(PENDING)
    assert requeued.id > ids[1]  # at the end of the queue, behind what already waits
    assert retried.stdout == f"#{ids[0]} queued again as #{requeued.id}\n"
    assert requeued.notification.alerts[0].name == "A" and requeued.attempts == 0
    assert monitor_cli("outbox", "drop", str(ids[1]), "--config", str(config)).returncode == 0
    assert store.entries(DEAD) == []
    again = monitor_cli("outbox", "drop", str(ids[0]), "--config", str(config))
    assert again.returncode == 2
    assert again.stderr.strip() == (
        f"lossguard-monitor: error: not a dead letter: #{ids[0]} (see lossguard-monitor status)"
    )
    state.close()
