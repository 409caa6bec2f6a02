"""The stuck-rank watch's judgement, on a clock of the test's own (the live cases, with real
ranks under gloo, are in tests/agent/test_rank_faults.py): a rank still blocked in one collective
``distributed.stop_grace`` after a stop signal or command ends with exit code 75, naming it;
one that waits less, that is in no collective, or in a checkpoint's write, does not."""

from __future__ import annotations

import signal
import threading

import pytest

from lossguard.agent import distributed, stuck_rank
from lossguard.agent.distributed import InFlight
from lossguard.agent.stuck_rank import StuckRankWatch


class Ended(Exception):
    pass


class Judged:
    """A watch with no thread of its own (``check`` on the test's clock), over a main thread
    whose collective the test sets, that raises ``Ended`` where it would end the rank."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, signalled: str | None = None) -> None:
        self.blocked: InFlight | None = None
        monkeypatch.setattr(stuck_rank, "in_collective", lambda thread: self.blocked)

        def end_rank(why: str) -> None:
            raise Ended(why)

        monkeypatch.setattr(stuck_rank, "end_rank", end_rank)
        self.watch = StuckRankWatch(
            grace_s=20, stop_asked=lambda: None, signalled=signalled, watching=False
        )


def test_stuck_for_the_grace_after_a_stop_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    judged = Judged(monkeypatch)
    judged.blocked = InFlight("all_reduce: log interval totals", 100.0)
    judged.watch.check(5000.0)  # blocked for long, but no stop asked: the timeout's business
    judged.watch.stop_at = (110.0, "SIGTERM")
    judged.watch.check(129.9)
    with pytest.raises(Ended) as ended:
        judged.watch.check(130.0)
    assert str(ended.value) == (
        "SIGTERM came 20 s ago and this rank is still blocked in all_reduce: log interval "
        "totals (for 30 s)"
    )


def test_the_grace_counts_from_entering_a_collective_after_the_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank that got back to Python after the signal (the graceful stop's own collectives)
    gets the whole grace for each collective it enters; a checkpoint's write gets all the
    time it takes."""
    judged = Judged(monkeypatch)
    judged.watch.stop_at = (100.0, "the stop command")
    judged.blocked = InFlight("all_gather_object: RNG states and health", 115.0)
    judged.watch.check(134.0)
    judged.blocked = InFlight("dcp.save: checkpoint shards", 134.0, io=True)
    judged.watch.check(1000.0)
    judged.blocked = InFlight("barrier: the run ends", 1000.0)
    with pytest.raises(Ended, match=r"^the stop command came 920 s ago .* barrier: the run ends"):
        judged.watch.check(1020.0)


def test_a_signal_before_the_watch_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM that came while the Guard started (its handler ran) is the watch's too."""
    judged = Judged(monkeypatch, signalled="SIGTERM")
    assert judged.watch.stop_at is not None and judged.watch.stop_at[1] == "SIGTERM"


def test_a_stop_signal_reaches_the_watch_while_the_main_thread_is_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The signal's wake-up byte reaches the watch thread without the main thread running
    Python (here: the handler only records it)."""
    monkeypatch.setattr(stuck_rank, "in_collective", lambda thread: None)
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    watch = StuckRankWatch(grace_s=20, stop_asked=lambda: None)
    try:
        signal.raise_signal(signal.SIGUSR1)
        seen = threading.Event()
        for _ in range(200):
            if watch.stop_at is not None:
                break
            seen.wait(0.05)
    finally:
        watch.close()
        signal.signal(signal.SIGUSR1, previous)
    assert watch.stop_at is not None and watch.stop_at[1] == "SIGUSR1"
    assert received == [signal.SIGUSR1]
    assert signal.set_wakeup_fd(-1) == -1  # put back as it was


def test_the_collective_context_marks_the_thread_and_ends_the_rank_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines: list[str] = []
    monkeypatch.setattr(distributed, "end_rank", lambda why: lines.append(why))
    with distributed.collective("all_reduce: test"):
        inside = distributed.in_collective(threading.current_thread())
        assert inside is not None and inside.what == "all_reduce: test" and not inside.io
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore")
    assert distributed.in_collective(threading.current_thread()) is None
    assert len(lines) == 1 and lines[0].startswith("all_reduce: test failed after 0 s (")
    assert lines[0].endswith("(RuntimeError: Connection closed by peer [127.0.0.1]:1234)")
