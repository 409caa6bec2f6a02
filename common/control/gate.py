"""Who may try a token on a control server's TCP listener, and when (docs/design.md "Control
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
SHOWN_PER_PEER = 4
"""Slots one address may hold with a token line waiting for its turn: the others stay free or
evictable for other addresses."""
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
        self._waiting: OrderedDict[object, Callable[[], None] | str] = OrderedDict()
        """Connections in a slot: how to cut one off, or its peer once it sent its token line."""
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
                silent = next((k for k, cut in self._waiting.items() if callable(cut)), None)
                if silent is None:
                    return False
                evicted = self._waiting.pop(silent)
                oldest = evicted if callable(evicted) else None
            self._waiting[key] = cut_off
        if oldest is not None:
            oldest()
        return True

    def shown(self, key: object, peer: str) -> bool:
        """``key`` of ``peer`` sent its token line: it keeps its slot until judged. False: it
        is not to be judged (it was cut off meanwhile, or ``peer`` has ``SHOWN_PER_PEER``
        lines waiting already); refuse it."""
        with self._lock:
            if key not in self._waiting:
                return False
            if sum(1 for held in self._waiting.values() if held == peer) >= SHOWN_PER_PEER:
                return False
            self._waiting[key] = peer
            return True

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
            return self._take_turn(peer, self._clock())

    def turn_now(self, peer: str) -> float:
        """For a caller that cannot wait (an HTTP request): 0 when ``peer``'s turn is now,
        taking it; else the seconds until it, taking none (refuse the request: retry later)."""
        with self._lock:
            now = self._clock()
            _, _, next_at = self._failures.get(peer, (0, 0, 0.0))
            return next_at - now if next_at > now else self._take_turn(peer, now)

    def _take_turn(self, peer: str, now: float) -> float:
        count, pending, next_at = self._failures.pop(peer, (0, 0, 0.0))
        at = max(now, next_at)
        self._failures[peer] = (count, pending + 1, at + _backoff(count + pending))
        self._forget_oldest()
        return at - now

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
