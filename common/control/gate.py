"""Who may try a token on a control server's TCP listener, and when (DESIGN.md "Control
protocol"): a connection that has not been authenticated holds one of a few
pre-authentication slots, never one of an authenticated peer. When they are all taken, the
connection waiting longest *that has not sent its token line yet* is cut off to make room;
one that has sent it is never cut off (connections that send nothing cannot push out a client
that did), and when every slot holds such a one, a new connection is refused at once (busy).
A peer's token lines are judged one at a time: after a wrong one, each next one waits a
back-off that doubles with each failure in a row (to ``MAX_BACKOFF_S``), however many of its
connections wait, so tokens cannot be guessed at speed by connecting in parallel."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

PREAUTH_SLOTS = 16
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 5.0
REMEMBERED_PEERS = 4096


class PeerGate:
    """Pre-authentication slots and per-peer judgement turns (thread-safe)."""

    def __init__(
        self, *, slots: int = PREAUTH_SLOTS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._slots = slots
        self._clock = clock
        self._lock = threading.Lock()
        self._waiting: OrderedDict[object, Callable[[], None] | None] = OrderedDict()
        """Connections in a slot: how to cut one off, None once it sent its token line."""
        self._failures: OrderedDict[str, tuple[int, int, float]] = OrderedDict()
        """By peer: failures in a row, turns handed out and not yet judged, the next turn."""

    def enter(self, key: object, cut_off: Callable[[], None]) -> bool:
        """Take a pre-authentication slot for the new connection ``key``; when none is free,
        the oldest connection without a token line is cut off (``cut_off`` is how this one
        would be). False: every slot holds a connection that sent its token line; refuse
        this one."""
        with self._lock:
            oldest: Callable[[], None] | None = None
            if len(self._waiting) >= self._slots:
                silent = next((k for k, cut in self._waiting.items() if cut is not None), None)
                if silent is None:
                    return False
                oldest = self._waiting.pop(silent)
            self._waiting[key] = cut_off
        if oldest is not None:
            oldest()
        return True

    def shown(self, key: object) -> None:
        """``key`` sent its token line: it keeps its slot until judged."""
        with self._lock:
            if key in self._waiting:
                self._waiting[key] = None

    def leave(self, key: object) -> None:
        """Give back the slot ``enter`` took (authenticated, refused, gone or cut off)."""
        with self._lock:
            self._waiting.pop(key, None)

    def turn(self, peer: str) -> float:
        """Seconds until a token line of ``peer`` may be judged (0: now), taking that turn.
        A peer's turns are spaced by the back-off its failures so far, and the turns already
        handed out, would earn: one line at a time is judged at once, and connections sent
        together cannot share a turn."""
        with self._lock:
            now = self._clock()
            count, pending, next_at = self._failures.pop(peer, (0, 0, 0.0))
            at = max(now, next_at)
            self._failures[peer] = (count, pending + 1, at + _backoff(count + pending))
            self._forget_oldest()
        return at - now

    def turn_now(self, peer: str) -> float:
        """For a caller that cannot wait (an HTTP request): 0 when ``peer``'s turn is now,
        taking it; else the seconds until it, taking none (refuse the request: retry later)."""
        with self._lock:
            _, _, next_at = self._failures.get(peer, (0, 0, 0.0))
            wait = next_at - self._clock()
        return wait if wait > 0 else self.turn(peer)

    def failed(self, peer: str) -> None:
        """A wrong token (or none) from ``peer``, judged at its turn: one failure more."""
        with self._lock:
            count, pending, next_at = self._failures.pop(peer, (0, 1, 0.0))
            self._failures[peer] = (count + 1, max(0, pending - 1), next_at)
            self._forget_oldest()

    def succeeded(self, peer: str) -> None:
        """The right token from ``peer``: its failures are forgotten."""
        with self._lock:
            self._failures.pop(peer, None)

    def _forget_oldest(self) -> None:
        while len(self._failures) > REMEMBERED_PEERS:
            self._failures.popitem(last=False)


def _backoff(failures: int) -> float:
    """The wait after ``failures + 1`` wrong lines in a row (doubling, to ``MAX_BACKOFF_S``)."""
    return float(min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2**failures))
