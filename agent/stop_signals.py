"""SIGTERM, SIGINT and SIGUSR1 during training: the first asks the loop to save and stop at the
next step boundary (SIGUSR1: preempted, the run is to be requeued; the others: stopped); a second
one gets the default action (the handlers are put back at the first).

They are caught from the start: ``lossguard-agent run`` catches them as soon as it has parsed
its command line (``caught_for_guard``, before it imports torch and builds the model) and its
Guard takes that catcher over (``StopSignals.take_over``), with the signal if one came; a Guard
in a user's loop catches them from the start of ``Guard.__init__``."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PREEMPT_SIGNAL = signal.SIGUSR1
"""Slurm's warning before a time limit (``--signal=B:USR1@…``): save, exit with the requeue code."""


class StopSignals:
    """Records the first stop signal for the training loop to act on."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        """The handlers from before ``install``, by signal (empty: not installed)."""

    @classmethod
    def take_over(cls) -> StopSignals:
        """The catcher that ``caught_for_guard`` installed, once (with the signal it got, if
        one came); else a new one, not installed yet."""
        global _handed_over
        signals, _handed_over = _handed_over or cls(), None
        return signals

    def install(self) -> None:
        """Catch the stop signals (only possible, and only done, on the main thread). Once
        installed, again does nothing: also after the first signal, whose handling put back the
        handlers from before, so that a second one gets their action."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        if self.received is not None:  # one came while installing: those set after it go back too
            self._put_back()

    def uninstall(self) -> None:
        """Put back the handlers that were there before, where ours are still installed."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)
        self._previous = {}

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
        if self.received is None:
            self.received = signum
        self._put_back()

    def _put_back(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


_handed_over: StopSignals | None = None
"""The catcher of ``caught_for_guard`` until a Guard takes it over."""


@contextlib.contextmanager
def caught_for_guard() -> Iterator[StopSignals]:
    """Catch the stop signals from now on, for the Guard created inside to take over
    (``StopSignals.take_over``) with any signal that came before it. On the way out, the
    handlers from before are put back where this catcher's are still installed (a start that
    failed before its Guard took over)."""
    global _handed_over
    signals = StopSignals()
    signals.install()
    _handed_over = signals
    try:
        yield signals
    finally:
        _handed_over = None
        signals.uninstall()


class _Catching(Protocol):
    signals: StopSignals


C = TypeVar("C", bound=_Catching)
P = ParamSpec("P")


def catching_from_the_start(
    init: Callable[Concatenate[C, P], None],
) -> Callable[Concatenate[C, P], None]:
    """For the ``__init__`` of a class whose ``signals`` catch the stop signals (Guard): they
    are caught before ``init`` runs (``StopSignals.take_over``); if it raises, the handlers
    from before are put back (a failed start swallows no signal)."""

    @functools.wraps(init)
    def start(self: C, /, *args: P.args, **kwargs: P.kwargs) -> None:
        self.signals = StopSignals.take_over()
        self.signals.install()
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self.signals.uninstall()
            raise

    return start


def ignore_stop_signals() -> None:
    """Once the run has ended and saved: a late stop signal must not turn its exit code into a
    kill while the process exits (on the main thread only, where handlers can be set)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
