"""A console command whose reader has gone (``lossguard-ctl ... | head -0``) ends quietly:
no BrokenPipeError traceback, exit status 141 as ``cat`` killed by SIGPIPE would give; a command
that had returned a failure code before its buffered output met the closed pipe keeps it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from lossguard.common.cli import EXIT_CLOSED_PIPE, quiet_on_closed_pipe
from lossguard.monitor.alert_store import AlertStore
from tests.support.processes import REPO

BIN = Path(sys.executable).parent


def through_closed_pipe(*argv: str, buffered: bool) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with its standard output a pipe whose reading end is closed before it
    starts (what ``| head -0`` does, without the race), its stderr captured. ``buffered``:
    the output meets the closed pipe at the end, else at the first ``print``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            argv,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
            env=env if buffered else {**env, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        os.close(write)


@pytest.mark.live
@pytest.mark.parametrize("buffered", [False, True])
def test_ctl_ends_quietly_when_its_reader_has_gone(tmp_path: Path, buffered: bool) -> None:
    """``lossguard-ctl checkpoints`` without an agent lists the checkpoints on disk."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    ctl = str(BIN / "lossguard-ctl")
    done = through_closed_pipe(
        ctl, "--run-dir", str(tmp_path / "run"), "checkpoints", buffered=buffered
    )
    assert done.stderr == "" and done.returncode == EXIT_CLOSED_PIPE


@pytest.mark.live
@pytest.mark.parametrize("buffered", [False, True])
def test_monitor_status_ends_quietly(tmp_path: Path, buffered: bool) -> None:
    """No daemon answers: status, cut short at its first line, exits 141; status that
    returned its own failure (1) before its output met the closed pipe keeps it."""
    state = AlertStore(tmp_path / "state.db")
    state.close()
    config = tmp_path / "monitor.yml"
    settings = {
        "rules": {"files": [str(REPO / "alerts" / "lossguard.rules.yml")]},
        "state": {"path": str(tmp_path / "state.db")},
        "scrape": {"runs_root": str(tmp_path / "runs")},
    }
    config.write_text(yaml.safe_dump(settings))
    monitor = str(BIN / "lossguard-monitor")
    done = through_closed_pipe(monitor, "status", "--config", str(config), buffered=buffered)
    assert done.stderr == "" and done.returncode == (1 if buffered else EXIT_CLOSED_PIPE)


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden() -> None:
    """A socket's EPIPE (an agent gone mid-request) is a real error, raised as before."""

    @quiet_on_closed_pipe
    def send() -> int:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        send()


def test_every_console_command_is_quiet_on_a_closed_pipe() -> None:
    """Each ``[project.scripts]`` module's ``main`` is wrapped by the one shared helper."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    wrapper = quiet_on_closed_pipe(lambda: 0).__code__
    for name, target in scripts.items():
        module = importlib.import_module(target.split(":")[0])
        assert module.main.__code__ is wrapper, name
