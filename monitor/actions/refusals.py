"""How many refused Alertmanager alerts get a record and a log line of their own: a sender
with the webhook's token chooses each alert's labels and ``startsAt``, so every alert of a
flood is a new instance. The first ``RECORDED_PER_WINDOW`` refusals of each window are recorded
one by one (an operator reads why); the rest are counted (the actions metric, and one summary
line per window) without a row or a line each, so a flood can neither grow the state database
and the log without bound nor bury the real actions in ``/api/v1/actions``."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("lossguard.monitor.actions")

RECORDED_PER_WINDOW = 20
WINDOW_S = 60.0
MAX_HELD = 1000
"""Alerts from Alertmanager awaiting the monitor's own view at once; beyond it, refused."""


class RefusalBudget:
    """The per-window budget of refusals recorded one by one (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window_start: float | None = None
        self._recorded = 0
        self._unrecorded = 0
        self._runs: set[str] = set()

    def allow(self, now: float, run_id: str) -> bool:
        """Whether this refusal gets a record and a line; else it is only counted."""
        with self._lock:
            self._roll(now)
            if self._recorded < RECORDED_PER_WINDOW:
                self._recorded += 1
                return True
            self._unrecorded += 1
            if len(self._runs) < 100:
                self._runs.add(run_id)
            return False

    def _roll(self, now: float) -> None:
        """Start a new window once the current one is over, summing up the one that ended."""
        if self._window_start is not None and now - self._window_start < WINDOW_S:
            return
        if self._unrecorded:
            log.warning(
                "refused %d more alerts from Alertmanager in %.0f s without recording each "
                "(over %d a window: a flood?), for %s%d runs; counted in "
                'lossguard_monitor_actions_total{result="refused"}',
                self._unrecorded,
                now - (self._window_start or now),
                RECORDED_PER_WINDOW,
                "at least " if len(self._runs) >= 100 else "",
                len(self._runs),
            )
        self._window_start, self._recorded, self._unrecorded = now, 0, 0
        self._runs = set()

    def flush(self, now: float) -> None:
        """Sum up a window that has ended, if no refusal came since (each decision calls it)."""
        with self._lock:
            if self._window_start is not None and now - self._window_start >= WINDOW_S:
                self._roll(now)
