"""SIGTERM, SIGINT and SIGUSR1 during training: the first asks the loop to save and stop at the
next step boundary (SIGUSR1: preempted, the run is to be requeued; the others: stopped); a second
one gets the default action (the handlers are put back at the first)."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PREEMPT_SIGNAL = signal.SIGUSR1
"""Slurm's warning before a time limit (``--signal=B:USR1@…``): save, exit with the requeue code."""


class StopSignals:
    """Records the first stop signal for the training loop to act on."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Catch the stop signals (only possible, and only done, on the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        """Put back the handlers that were there before, where ours are still installed."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)

    @property
    def pending(self) -> bool:
        return self.received is not None

    @property
    def kind(self) -> int:
        """0: no signal; 1: stop; 2: preempt (ordered: of several ranks' kinds, the larger wins)."""
        if self.received is None:
            return 0
        return 2 if self.received == PREEMPT_SIGNAL else 1

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def ignore_stop_signals() -> None:
    """Once the run has ended and saved: a late stop signal must not turn its exit code into a
    kill while the process exits (on the main thread only, where handlers can be set)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
