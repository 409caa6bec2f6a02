"""Delivers the outbox: one worker per receiver integration ("lane"), in order, at the pace the
service allows, retrying transient failures with exponential backoff and jitter (or after the
reply's Retry-After) until they succeed, and moving permanent failures to the dead letters.

A notification is marked delivered in the same moment its success reply is read, and is never
sent again after that. A monitor killed between a receiver accepting a message and that mark
sends it once more after restart; PagerDuty folds that into the same incident by its dedup_key."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping

import requests

from lossguard.monitor.notify.http import Outcome
from lossguard.monitor.notify.integrations import Integration
from lossguard.monitor.notify.model import Notification
from lossguard.monitor.notify.store import NotifyStore, OutboxEntry

log = logging.getLogger("lossguard.monitor.notify")
IDLE_POLL_S = 5.0  # a lane with nothing to do looks again this often, woken or not
Observer = Callable[[Notification, str], None]  # (what was tried, its result)


class Backoff:
    """Exponential backoff with equal jitter: attempt n waits min(max, min * 2**(n-1)) times a
    random factor in [0.5, 1)."""

    def __init__(self, min_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.min_s, self.max_s = min_s, max_s
        self.rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        ceiling = min(self.max_s, self.min_s * 2 ** min(attempt - 1, 62))
        return ceiling * (0.5 + self.rng.random() / 2)


class Deliverer:
    """The delivery workers of every configured lane."""

    def __init__(
        self,
        store: NotifyStore,
        integrations: Mapping[str, Integration],
        *,
        timeout_s: float,
        backoff: Backoff,
        observe: Observer | None = None,
    ) -> None:
        self.store = store
        self.integrations = integrations
        self.timeout_s = timeout_s
        self.backoff = backoff
        self.observe = observe or (lambda notification, result: None)
        self._stop = threading.Event()
        self._wake = {lane: threading.Event() for lane in integrations}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Bury what no configured lane can deliver any more, then start a worker per lane."""
        for lane in self.store.pending_lanes() - set(self.integrations):
            while (entry := self.store.next_pending(lane)) is not None:
                self._finish(entry, Outcome("dead", f"receiver {lane} is no longer configured"))
        for lane in self.integrations:
            thread = threading.Thread(
                target=self._work, args=(lane,), name=f"deliver {lane}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def wake(self) -> None:
        """New notifications are queued: look now."""
        for event in self._wake.values():
            event.set()

    def stop(self) -> None:
        """Stop the workers, letting a request in flight finish (its reply is recorded)."""
        self._stop.set()
        self.wake()
        deadline = time.monotonic() + self.timeout_s + 1
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _work(self, lane: str) -> None:
        integration = self.integrations[lane]
        session = requests.Session()
        last_request = float("-inf")
        while not self._stop.is_set():
            self._wake[lane].clear()  # a wake from here on is not lost
            try:
                entry = self.store.next_pending(lane)
                if entry is None:
                    self._sleep(lane, IDLE_POLL_S)
                    continue
                wait = max(entry.next_attempt, last_request + integration.pace_s) - time.time()
                if wait > 0:
                    self._sleep(lane, wait)
                    continue
                last_request = time.time()
                outcome = integration.deliver(entry.notification, entry.id, session, self.timeout_s)
                self._finish(entry, outcome)
            except Exception:  # a worker outlives any one notification
                log.exception("delivery on %s failed unexpectedly", lane)
                self._sleep(lane, self.backoff.max_s)
        session.close()

    def _finish(self, entry: OutboxEntry, outcome: Outcome) -> None:
        now = time.time()
        what = f"notification #{entry.id} to {entry.lane}"
        if outcome.result == "delivered":
            self.store.delivered(entry.id, now)
            log.debug("%s delivered", what)
        elif outcome.result == "dead":
            self.store.failed(entry.id, outcome.detail, None, now)
            log.error("%s failed for good, moved to dead letters: %s", what, outcome.detail)
        else:
            delay = outcome.retry_after_s
            if delay is None:
                delay = self.backoff.delay(entry.attempts + 1)
            self.store.failed(entry.id, outcome.detail, now + delay, now)
            log.warning("%s failed (%s); retrying in %.1fs", what, outcome.detail, delay)
        self.observe(entry.notification, outcome.result)

    def _sleep(self, lane: str, seconds: float) -> None:
        self._wake[lane].wait(seconds)
