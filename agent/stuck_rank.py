"""Ending a rank that is stuck in a collective.

A rank blocked in a collective its peers never enter waits inside the backend, where neither a
Python signal handler nor a control command can reach it: the first runs only when the main
thread gets back to Python, the second at the next step boundary. A watch thread sees both
anyway (the signal through ``signal.set_wakeup_fd``, the command in the control server's queue)
and ends the rank with the retryable exit code when the main thread is still in one
collective ``distributed.stop_grace`` after either, naming the collective in the one line it
logs (``distributed.collective``). A checkpoint's collective writes and reads (``io``) are
never taken for stuck: they end at ``distributed.timeout``, as every collective does, with the
backend's error (``distributed.collective``).
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

POLL_S = 0.5


class StuckRankWatch:
    """Watches the thread that created it (the training loop's) from a daemon thread.
    ``stop_asked``: the name of a stop command waiting for the loop (rank 0's control server),
    else None; ``grace_s``: ``distributed.stop_grace``; ``signalled``: a stop signal that
    came before the watch (while the Guard started), by name."""

    def __init__(
        self,
        *,
        grace_s: float,
        stop_asked: Callable[[], str | None],
        signalled: str | None = None,
        watching: bool = True,
    ) -> None:
        """``watching``: start the thread (False: only ``check``, for a test's clock)."""
        self.grace_s = grace_s
        self.stop_asked = stop_asked
        self.main = threading.current_thread()
        self.stop_at: tuple[float, str] | None = (
            (time.monotonic(), signalled) if signalled is not None else None
        )  # when the first stop came, and what
        self._closed = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._wakeup_set = False
        self._thread: threading.Thread | None = None
        if not watching:
            return
        with contextlib.suppress(ValueError):  # not the main thread: no signal to watch
            previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
            if previous == -1:
                self._wakeup_set = True
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
        if blocked is None or self.stop_at is None or blocked.io:
            return
        asked_at, asked = self.stop_at
        if now - max(asked_at, blocked.since) >= self.grace_s:
            end_rank(
                f"{asked} came {now - asked_at:.0f} s ago and this rank is still blocked in "
                f"{blocked.what} (for {now - blocked.since:.0f} s)"
            )

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        if self._wakeup_set:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:  # closed from another thread: the descriptor stays, open
                return
        os.close(self._read)
        os.close(self._write)
