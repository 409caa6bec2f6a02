"""Stop signals from the start: ``lossguard-agent run`` catches SIGTERM, SIGINT and SIGUSR1
before it loads torch and builds its model, its Guard takes that catcher over, and a signal that
came while the run started stops it at its first step boundary with the exit-code contract
(3 stopped, 138 preempted), saving nothing while nothing has trained. (Signals mid-run:
tests/agent/checkpoint/test_resume.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from torch import nn

from lossguard.agent import Guard
from lossguard.agent.stop_signals import STOP_SIGNALS, StopSignals, caught_for_guard
from lossguard.common.exitcodes import EXIT_PREEMPTED, EXIT_STOPPED
from lossguard.common.rundir.checkpoints import list_checkpoints
from tests.agent.test_guard import guard_config
from tests.support.processes import start_agent, wait_for
from tests.support.runs import events, json_lines, tiny_settings, write_config

pytestmark = pytest.mark.live


class Before:
    """Handlers standing in for the ones from before lossguard's: they record what they get."""

    def __init__(self) -> None:
        self.got: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.got.append(signum)

    def installed(self) -> bool:
        return all(signal.getsignal(s) is self for s in STOP_SIGNALS)


@pytest.fixture
def before() -> Iterator[Before]:
    handler = Before()
    saved = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield handler
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous)


def send(signum: int, caught: Callable[[], object]) -> None:
    """Signal this process; wait until ``caught()`` says it was handled (on the main thread, at
    the interpreter's next check)."""
    os.kill(os.getpid(), signum)
    wait_for(caught, 10, f"{signal.Signals(signum).name} to be handled")


def test_the_guard_takes_over_a_signal_caught_before_it(before: Before) -> None:
    with caught_for_guard() as early:
        assert not before.installed()
        send(signal.SIGTERM, lambda: early.pending)
        assert before.installed()  # put back at the first: a second gets their action
        taken = StopSignals.take_over()
        assert taken is early and taken.name == "SIGTERM" and taken.kind == 1
        taken.install()  # already installed: not again, not over the handlers from before
        assert before.installed()
        send(signal.SIGTERM, lambda: before.got)
        assert taken.name == "SIGTERM" and before.got == [signal.SIGTERM]
        assert StopSignals.take_over() is not early  # handed over once
    assert before.installed()


def test_the_guard_takes_over_the_catcher_and_puts_back_the_handlers_from_before(
    before: Before,
) -> None:
    with caught_for_guard() as early:
        taken = StopSignals.take_over()
        taken.install()
        assert taken is early and not before.installed()
        send(signal.SIGUSR1, lambda: taken.pending)
        assert taken.kind == 2 and taken.name == "SIGUSR1" and before.installed()
    with caught_for_guard():
        taken = StopSignals.take_over()
        taken.uninstall()  # the Guard closes, no signal came
        assert before.installed()
    with caught_for_guard():  # the start failed before a Guard took over
        assert not before.installed()
    assert before.installed() and not before.got


def test_a_guard_that_fails_to_start_puts_the_handlers_back(tmp_path: Path, before: Before) -> None:
    with caught_for_guard():
        with pytest.raises(ValueError, match="max_steps"):
            Guard(tmp_path, model=nn.Linear(2, 1), config=guard_config(), max_steps=0)
        assert before.installed()  # not swallowed by a Guard that never started
    with pytest.raises(ValueError, match="grad_clip"):
        Guard(tmp_path, model=nn.Linear(2, 1), config=guard_config(), grad_clip=-1.0)
    assert before.installed()


class SignalledWhileStarting(nn.Linear):
    """A model that gets SIGTERM while Guard.__init__ first looks at it."""

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        if not getattr(self, "signalled", False):
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().parameters(recurse)


def test_a_signal_while_a_users_guard_starts_stops_it_at_the_first_boundary(
    tmp_path: Path, before: Before
) -> None:
    model = SignalledWhileStarting(4, 1)
    guard = Guard(tmp_path / "run", model=model, config=guard_config(), progress=False)
    try:
        assert guard.signals.name == "SIGTERM" and before.installed()
        assert guard.untrained
        guard.poll()
        assert guard.stop_requested and guard.outcome == "stopped"
        assert guard.exit_code() == EXIT_STOPPED
        guard.finish()
    finally:
        guard.close()
    signalled = [e for e in events(tmp_path / "run") if e["event"] == "signal"]
    assert [(e["step"], e["signal"], e["preempted"]) for e in signalled] == [(0, "SIGTERM", False)]
    assert not list_checkpoints(tmp_path / "run" / "checkpoints")  # nothing trained: no save
    assert not before.got


def test_the_agent_cli_module_loads_neither_pydantic_nor_torch() -> None:
    """What ``lossguard-agent`` imports before it catches the stop signals."""
    code = (
        "import sys, lossguard.agent.cli; print(sorted({'pydantic', 'torch'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def loading_torch(pid: int) -> bool:
    """Whether process ``pid`` has mapped torch's library (it is importing torch, or did)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # it ended
        return False


def settings(tmp_path: Path, cache: Path, when: str) -> dict[str, Any]:
    """The tiny run; signalled as agent.json appears, with an evaluation at step 0 that takes
    over a second, so that the signal surely comes before the first step boundary."""
    train = {"eval_batches": 200} if when == "agent.json" else {}
    return tiny_settings(tmp_path / "runs", cache, train=train)


@pytest.mark.parametrize(
    ("signum", "when", "code", "outcome"),
    [
        (signal.SIGTERM, "agent.json", EXIT_STOPPED, "stopped"),
        (signal.SIGUSR1, "agent.json", EXIT_PREEMPTED, "preempted"),
        (signal.SIGINT, "loading torch", EXIT_STOPPED, "stopped"),
    ],
)
def test_a_signal_while_the_agent_starts_stops_it_at_step_0_with_its_code(
    tmp_path: Path,
    corpus_cache: Path,
    signum: signal.Signals,
    when: str,
    code: int,
    outcome: str,
) -> None:
    config = write_config(tmp_path / "c.yaml", settings(tmp_path, corpus_cache, when))
    run_dir = tmp_path / "runs" / "tiny"
    agent = start_agent(config)
    if when == "agent.json":
        wait_for((run_dir / "agent.json").exists, 120, "agent.json")
    else:
        wait_for(lambda: loading_torch(agent.pid), 60, "the agent to load torch")
    agent.send_signal(signum)
    _, stderr = agent.communicate(timeout=120)
    assert agent.returncode == code, stderr
    signalled = [e for e in events(run_dir) if e["event"] == "signal"]
    assert [(e["step"], e["signal"]) for e in signalled] == [(0, signum.name)]
    assert signalled[0]["preempted"] == (outcome == "preempted")
    assert not [r for r in json_lines(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    # nothing trained, nothing saved: the run directory starts afresh again
    assert not list_checkpoints(run_dir / "checkpoints")
    assert "nothing trained yet, nothing saved" in stderr
    assert json.loads((run_dir / "agent.json").read_text())["exit"] == outcome
