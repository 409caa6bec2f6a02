"""The notification benchmark runs end to end and reports what it measured."""

from __future__ import annotations

import pytest

from lossguard.monitor.notify.bench import main


def test_benchmark_dispatches_and_delivers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--alerts", "40", "--runs", "4"]) == 0
    out = capsys.readouterr().out
    assert "dispatch firing alerts into 4 notifications" in out
    assert "dispatch resolved alerts into 4 notifications" in out
    assert "deliver the outbox (Deliverer)" in out and "1.00x" in out
    assert "command: python -m lossguard.monitor.notify.bench --alerts 40 --runs 4" in out


def test_benchmark_refuses_more_runs_than_alerts() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--alerts", "2", "--runs", "3"])
    assert exit_.value.code == 2
