"""Delivers the outbox: one worker per receiver integration ("lane"), in order, at the pace the
service allows, retrying transient failures with exponential backoff and jitter (or after the
reply's Retry-After) until they succeed, and moving permanent failures to the dead letters.

A notification is marked delivered in the same moment its success reply is read, and is never
sent again after that. A monitor killed between a receiver accepting a message and that mark
sends it once more after restart; PagerDuty folds that into the same incident by its dedup_key."""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping

import requests

from lossguard.monitor.notify.integrations import Integration
from lossguard.monitor.notify.integrations.http import Outcome
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


class Pace:
    """At most one request per ``gap_s`` to one destination, shared by every lane that sends
    there (two receivers with the same Slack webhook or PagerDuty key keep one pace)."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self._next = float("-inf")
        self._lock = threading.Lock()

    def claim(self, now: float) -> float:
        """0 and the slot is taken; else how long to wait before asking again."""
        with self._lock:
            if now >= self._next:
                self._next = now + self.gap_s
                return 0.0
            return self._next - now


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
        paces: dict[str, Pace] = {}
        self._pace = {
            lane: paces.setdefault(i.destination(), Pace(i.pace_s))
            for lane, i in integrations.items()
        }

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
        pace = self._pace[lane]
        session = requests.Session()
        while not self._stop.is_set():
            self._wake[lane].clear()  # a wake from here on is not lost
            try:
                entry = self.store.next_pending(lane)
                if entry is None:
                    self._sleep(lane, IDLE_POLL_S)
                    continue
                wait = entry.next_attempt - time.time()
                if wait <= 0:
                    wait = pace.claim(time.time())
                if wait > 0:
                    self._sleep(lane, wait)
                    continue
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
            self._record(lambda: self.store.delivered(entry.id, now), what)
            log.debug("%s delivered", what)
        elif outcome.result == "dead":
            self._record(lambda: self.store.failed(entry.id, outcome.detail, None, now), what)
            log.error("%s failed for good, moved to dead letters: %s", what, outcome.detail)
        else:
            delay = outcome.retry_after_s
            if delay is None:
                delay = self.backoff.delay(entry.attempts + 1)
            self._record(
                lambda: self.store.failed(entry.id, outcome.detail, now + delay, now), what
            )
            log.warning("%s failed (%s); retrying in %.1fs", what, outcome.detail, delay)
        self.observe(entry.notification, outcome.result)

    def _record(self, write: Callable[[], None], what: str) -> None:
        """Write an attempt's result, again and again while the database refuses: the mark
        of a delivered notification must not be lost, or it would be sent twice."""
        while True:
            try:
                write()
                return
            except sqlite3.Error as exc:
                if self._stop.is_set():
                    log.error("state database: %s; the result of %s is lost", exc, what)
                    return
                log.error("state database: %s; recording %s again in 1s", exc, what)
                self._stop.wait(1.0)

    def _sleep(self, lane: str, seconds: float) -> None:
        self._wake[lane].wait(seconds)
