"""The supervised training command: a process group of its own, its stderr passed through with
the last lines kept for the audit record."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence

from lossguard.common.control.address import SUPERVISOR_CONTROL_ENV
from lossguard.common.rundir.supervisor_file import RESUME_ENV
from lossguard.supervisor.tree import libc_prctl, signal_tree

STDERR_TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the supervisor dies (Linux), so a killed
    supervisor never leaves an unsupervised run behind. SIGUSR1 is ignored (and stays ignored
    across exec): the supervisor sends it to the whole tree, and torchrun would die of it; the
    agent installs its own handler."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    prctl = libc_prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def command_env(
    resume: str | None, control_tcp: str | None, base: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The environment of one start of the training command: ``base`` with ``RESUME_ENV``
    set to the checkpoint to resume from and ``SUPERVISOR_CONTROL_ENV`` to the supervisor's
    advertised TCP control address, each only when there is one (a stale value inherited from
    the supervisor's own environment never reaches the command)."""
    env = dict(base)
    for name, value in ((RESUME_ENV, resume), (SUPERVISOR_CONTROL_ENV, control_tcp)):
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return env


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

    def signal_tree(self, signum: int) -> None:
        """Send ``signum`` to the command and every process below it (the agent's ranks under
        torchrun, each in a session of its own)."""
        signal_tree(self.pid, signum)

    def end_group(self, kill_after_s: float) -> int:
        """End the whole process group: SIGTERM, then SIGKILL after ``kill_after_s`` (a hung
        process never acts on SIGTERM) to the group and everything below the command. Returns
        the command's exit status."""
        _signal_group(self.pid, signal.SIGTERM)
        status = self.wait(kill_after_s)
        if status is None:
            signal_tree(self.pid, signal.SIGKILL)
        _signal_group(self.pid, signal.SIGKILL)  # stragglers of the group, too
        return status if status is not None else self._popen.wait()


def forward_stop(child: TrainingProcess, signum: int, term_is_preemption: bool) -> None:
    """Pass a stop signal the supervisor got on to a running command: SIGUSR1 (preemption) to
    it and every process below it, so that the agent's ranks under torchrun get it (torchrun,
    started with SIGUSR1 ignored, survives it); SIGTERM and SIGINT to the command as SIGTERM
    (torchrun passes it on), or as SIGUSR1 with ``term_is_preemption``."""
    if child.poll() is not None:
        return
    if signum == signal.SIGUSR1 or (term_is_preemption and signum == signal.SIGTERM):
        child.signal_tree(signal.SIGUSR1)
    else:
        child.signal(signal.SIGTERM)


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
