"""Ending a rank that is stuck in a collective.

A rank blocked in a collective its peers never enter waits inside the backend, where neither a
Python signal handler nor a control command can reach it: the first runs only when the main
thread gets back to Python, the second at the next step boundary. A watch thread sees both
anyway (the signal through ``signal.set_wakeup_fd``, the command in the control server's queue)
and ends the rank with the retryable exit code when the main thread is still in one
collective ``distributed.stop_grace`` after either, or ``BACKSTOP_S`` past
``distributed.timeout`` (for a backend that does not time out by itself). The collective is
named in the one line it logs (``distributed.collective``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable

from lossguard.agent.distributed import end_rank, in_collective
from lossguard.agent.stop_signals import STOP_SIGNALS

BACKSTOP_S = 30.0
"""Past ``distributed.timeout``: gloo raises by then, NCCL's watchdog aborts; this is the rest."""
POLL_S = 0.5


class StuckRankWatch:
    """Watches the thread that created it (the training loop's) from a daemon thread.
    ``stop_asked``: the name of a stop command waiting for the loop (rank 0's control server),
    else None; ``grace_s``: ``distributed.stop_grace``."""

    def __init__(
        self, *, timeout_s: float, grace_s: float, stop_asked: Callable[[], str | None]
    ) -> None:
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.stop_asked = stop_asked
        self.main = threading.current_thread()
        self.stop_at: tuple[float, str] | None = None  # when the first stop came, and what
        self._closed = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous_fd: int | None = None
        with contextlib.suppress(ValueError):  # not the main thread: no signal to watch
            previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
            if previous == -1:
                self._previous_fd = previous
            else:  # someone else (an event loop) reads the wake-ups: leave them theirs
                signal.set_wakeup_fd(previous)
        self._thread = threading.Thread(target=self._run, name="lossguard-stuck-rank", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            ready, _, _ = select.select([self._read], [], [], POLL_S)
            if ready:
                self._signals(os.read(self._read, 64))
            if self.stop_at is None and (command := self.stop_asked()) is not None:
                self.stop_at = (time.monotonic(), f"the {command} command")
            self.check(time.monotonic())

    def _signals(self, received: bytes) -> None:
        stops = [signum for signum in received if signum in STOP_SIGNALS]
        if stops and self.stop_at is None:
            self.stop_at = (time.monotonic(), signal.Signals(stops[0]).name)

    def check(self, now: float) -> None:
        """End the rank if the main thread is stuck, as the module says."""
        blocked = in_collective(self.main)
        if blocked is None or self._closed.is_set():
            return
        what, since = blocked
        if self.stop_at is not None:
            asked_at, asked = self.stop_at
            if now - max(asked_at, since) >= self.grace_s:
                end_rank(
                    f"{asked} came {now - asked_at:.0f} s ago and this rank is still blocked "
                    f"in {what} (for {now - since:.0f} s)"
                )
        if now - since >= self.timeout_s + BACKSTOP_S:
            end_rank(
                f"blocked in {what} for {now - since:.0f} s, past distributed.timeout "
                f"({self.timeout_s:.0f} s)"
            )

    def close(self) -> None:
        self._closed.set()
        if self._previous_fd is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_fd)
        self._thread.join()
        os.close(self._read)
        os.close(self._write)
