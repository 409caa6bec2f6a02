"""The agent's exit without the interpreter's teardown keeps what a normal exit does (the exit
code, the atexit handlers, buffered output, a non-daemon thread's work), and only a run that
ended well takes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.live


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(("code", "torn_down"), [(0, False), (3, True)])
def test_atexit_output_and_code_are_kept_and_only_a_failure_is_torn_down(
    tmp_path: Path, code: int, torn_down: bool
) -> None:
    ran, finalized = tmp_path / "atexit-ran", tmp_path / "finalized"
    done = _run(
        "import atexit, pathlib, sys\n"
        "from lossguard.agent.quick_exit import exit_without_teardown\n"
        f"atexit.register(pathlib.Path({str(ran)!r}).write_text, 'yes')\n"
        "class Finalized:\n"  # a global freed only by the interpreter's teardown
        "    def __del__(self):\n"
        f"        pathlib.Path({str(finalized)!r}).write_text('yes')\n"
        "kept = Finalized()\n"
        "sys.stdout.write('buffered, no newline')\n"
        "sys.stderr.write('also buffered')\n"
        f"exit_without_teardown({code})\n"
    )
    assert done.returncode == code
    assert done.stdout == "buffered, no newline" and done.stderr == "also buffered"
    assert ran.read_text() == "yes"
    assert finalized.exists() == torn_down


def test_a_running_non_daemon_thread_is_waited_for(tmp_path: Path) -> None:
    out = tmp_path / "thread-wrote"
    done = _run(
        "import threading, pathlib\n"
        "from lossguard.agent.quick_exit import exit_without_teardown\n"
        "started = threading.Event()\n"
        "def work():\n"
        "    started.set()\n"
        "    threading.Event().wait(0.5)\n"
        f"    pathlib.Path({str(out)!r}).write_text('finished')\n"
        "threading.Thread(target=work).start()\n"
        "started.wait()\n"
        "exit_without_teardown(0)\n"
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "finished"
