"""Who may try a token on a control server's TCP listener, and when (DESIGN.md "Control
protocol"): a connection that has not shown the token holds one of a few pre-authentication
slots, never one of an authenticated peer; when they are all taken, the one waiting longest is
cut off to make room, so connections that never send a token cannot keep a client that does
out. After a wrong token, a peer's next attempt is judged only after a back-off that doubles
with each failure in a row, so tokens cannot be guessed at speed."""

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
    """Pre-authentication slots and per-peer back-off (thread-safe)."""

    def __init__(
        self, *, slots: int = PREAUTH_SLOTS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._slots = slots
        self._clock = clock
        self._lock = threading.Lock()
        self._waiting: OrderedDict[object, Callable[[], None]] = OrderedDict()  # key -> cut off
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # peer -> (n, until)

    def enter(self, key: object, cut_off: Callable[[], None]) -> None:
        """Take a pre-authentication slot for the connection ``key``; when none is free, the
        connection waiting longest is cut off (``cut_off`` is how this one would be)."""
        with self._lock:
            oldest = (
                self._waiting.popitem(last=False)[1] if len(self._waiting) >= self._slots else None
            )
            self._waiting[key] = cut_off
        if oldest is not None:
            oldest()

    def leave(self, key: object) -> None:
        """Give back the slot ``enter`` took (authenticated, refused, gone or cut off)."""
        with self._lock:
            self._waiting.pop(key, None)

    def wait_s(self, peer: str) -> float:
        """Seconds until an attempt of ``peer`` may be judged (0: now)."""
        with self._lock:
            _, until = self._failures.get(peer, (0, 0.0))
        return max(0.0, until - self._clock())

    def failed(self, peer: str) -> None:
        """A wrong token (or none) from ``peer``: its back-off doubles."""
        with self._lock:
            count, _ = self._failures.pop(peer, (0, 0.0))
            backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2**count)
            self._failures[peer] = (count + 1, self._clock() + backoff)
            while len(self._failures) > REMEMBERED_PEERS:
                self._failures.popitem(last=False)

    def succeeded(self, peer: str) -> None:
        """The right token from ``peer``: its failures are forgotten."""
        with self._lock:
            self._failures.pop(peer, None)
