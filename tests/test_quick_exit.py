"""The agent's exit without the interpreter's teardown keeps what a normal exit does: the exit
code, the atexit handlers, buffered output, and a non-daemon thread's work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )


def test_atexit_handlers_run_output_is_flushed_and_the_code_kept(tmp_path: Path) -> None:
    marker = tmp_path / "atexit-ran"
    done = _run(
        "import atexit, pathlib, sys\n"
        "from lossguard.agent.quick_exit import exit_without_teardown\n"
        f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
        "sys.stdout.write('buffered, no newline')\n"
        "sys.stderr.write('also buffered')\n"
        "exit_without_teardown(3)\n"
    )
    assert done.returncode == 3
    assert done.stdout == "buffered, no newline" and done.stderr == "also buffered"
    assert marker.read_text() == "yes"


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
