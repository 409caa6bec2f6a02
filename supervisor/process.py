"""The supervised training command: a process group of its own, its stderr passed through with
the last lines kept for the audit record."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import cast

STDERR_TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up before any fork (None: not Linux)."""
    try:
        return cast(Callable[..., int], ctypes.CDLL(None, use_errno=True).prctl)
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the supervisor dies (Linux), so a killed
    supervisor never leaves an unsupervised run behind."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class TrainingProcess:
    """One start of the training command (a new session: it and its children, e.g. torchrun's
    workers, form one process group)."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        self.started_at = time.time()
        self._popen = subprocess.Popen(
            list(command),
            env=dict(env),
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.pid = self._popen.pid
        self._tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._relay = threading.Thread(target=self._pass_stderr, daemon=True)
        self._relay.start()

    def _pass_stderr(self) -> None:
        assert self._popen.stderr is not None
        out = sys.stderr.buffer
        for line in iter(self._popen.stderr.readline, b""):
            with contextlib.suppress(OSError, ValueError):
                out.write(line)
                out.flush()
            self._tail.append(line.decode("utf-8", "replace").rstrip("\n"))

    def poll(self) -> int | None:
        """The exit status (negative: the signal that ended it), or None while it runs."""
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self) -> list[str]:
        """The last lines it wrote to stderr (all of them, once it has exited)."""
        if self._popen.poll() is not None:
            self._relay.join(timeout=5)
        return list(self._tail)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the command itself (torchrun passes it on to its workers)."""
        with contextlib.suppress(ProcessLookupError):
            self._popen.send_signal(signum)

    def end_group(self, kill_after_s: float) -> int:
        """End the whole process group: SIGTERM, then SIGKILL after ``kill_after_s`` (a hung
        process never acts on SIGTERM). Returns the command's exit status."""
        _signal_group(self.pid, signal.SIGTERM)
        status = self.wait(kill_after_s)
        _signal_group(self.pid, signal.SIGKILL)  # stragglers of the group, too
        return status if status is not None else self._popen.wait()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def end_leftover_group(pgid: int) -> bool:
    """SIGKILL a process group that a killed supervisor left behind; whether one was there."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def describe_status(status: int) -> str:
    """``exit code 70`` or ``signal SIGKILL``."""
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit code {status}"
