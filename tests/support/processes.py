"""Starting and stopping the processes a test runs (agent, monitor, supervisor, CLIs), and
waiting on a condition with a deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


LONGEST_POLL_S = 0.05


def wait_for(predicate, timeout: float, what: str, interval: float = 0.005):
    """Poll ``predicate`` until it returns something truthy; at the deadline, fail naming it.

    The pause between polls starts at ``interval`` and grows to LONGEST_POLL_S: a condition met at
    once is seen at once, and a long wait does not spend the CPU the processes it waits on
    need (a 5 ms poll that parses a run's metrics file costs a third of a core)."""
    deadline = time.monotonic() + timeout
    pause = interval
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(pause)
        pause = max(pause, min(LONGEST_POLL_S, pause * 1.5))
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_cli(
    *args: str, timeout: float = 240, module: str = "lossguard.agent.cli", **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lossguard.agent.cli ARGS`` (or another ``module``) with its output
    captured (not a TTY)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        check=False,
    )


def monitor_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``lossguard-monitor ARGS`` with its output captured."""
    return run_cli(*args, timeout=120, module="lossguard.monitor.cli")


def ctl_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``lossguard-ctl ARGS``, as an operator does, with its output captured."""
    return run_cli(*args, timeout=120, module="lossguard.ctl.cli")


def start_agent(
    config: Path,
    *args: str,
    env: dict[str, str] | None = None,
    module: str = "lossguard.agent.cli",
) -> subprocess.Popen:
    """Start ``lossguard-agent run CONFIG ARGS`` in the background (output captured); ``module``
    may be a stand-in that runs it (tests/support/fake_gpu_agent.py)."""
    return subprocess.Popen(
        [sys.executable, "-m", module, "run", str(config), "--no-progress", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def start_monitor(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``lossguard-monitor run --config CONFIG ARGS`` with ``env`` added to the
    environment (stderr captured to a file beside the config, so a long run never blocks on a
    full pipe)."""
    log = open(config.with_suffix(".log"), "a")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, "-m", "lossguard.monitor.cli", "run", "--config", str(config), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def stop_process(process: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, then wait; if it does not end in ``timeout``: a Python process gets SIGABRT
    first (its threads' stacks go to its stderr, see PYTHONFAULTHANDLER in tests/conftest.py: where
    it hung), then SIGKILL."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            if _runs_python(process):
                process.send_signal(signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)
            process.kill()
            process.wait()
    return int(process.returncode)


def _runs_python(process: subprocess.Popen) -> bool:
    try:
        return os.path.realpath(f"/proc/{process.pid}/exe") == os.path.realpath(sys.executable)
    except OSError:
        return False


def stop_processes(*processes: subprocess.Popen, timeout: float = 30) -> list[int]:
    """:func:`stop_process` for each, all SIGTERMed first so that their shutdowns (an agent's
    final save) overlap; their exit codes, in order."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    return [stop_process(process, timeout) for process in processes]


def supervisor_argv(run_dir: Path, *options: str, command: list[str]) -> list[str]:
    """``lossguard-supervise run --run-dir RUN_DIR OPTIONS -- COMMAND``."""
    cli = [sys.executable, "-m", "lossguard.supervisor.cli", "run"]
    return [*cli, "--run-dir", str(run_dir), *options, "--", *command]
