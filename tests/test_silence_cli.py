"""``lossguard-monitor silence add|list|expire`` and ``status`` on a state database, as an
operator uses them (the dispatcher's tests show what a silence mutes)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO, monitor_cli, write_monitor_config

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
    }
    for args, message in cases.items():
        extra = ("--comment", "c") if args[0] == "add" else ()
        result = monitor_cli("silence", *args, "--config", c, *extra)
        assert result.returncode == 2, args
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("lossguard-monitor: error: ") and message in line, line
