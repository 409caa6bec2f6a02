"""The stuck-rank watch's judgement, on a clock of the test's own (the live cases, with real
ranks under gloo, are in tests/test_rank_faults.py): a rank still blocked in one collective
``distributed.stop_grace`` after a stop signal or command ends with exit code 75, naming it;
one blocked past ``distributed.timeout`` too; one that waits less, or is in no collective, not."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

from lossguard.agent import distributed, stuck_rank
from lossguard.agent.stuck_rank import BACKSTOP_S, StuckRankWatch


class Ended(Exception):
    pass


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StuckRankWatch, dict[str, object]]]:
    """A watch over this thread with 600 s timeout and 20 s grace; ``state['blocked']`` is the
    collective it is in (name, since), and ending the rank raises ``Ended``."""
    state: dict[str, object] = {"blocked": None, "stop": None}
    monkeypatch.setattr(stuck_rank, "in_collective", lambda thread: state["blocked"])

    def end_rank(why: str) -> None:
        raise Ended(why)

    monkeypatch.setattr(stuck_rank, "end_rank", end_rank)
    watch = StuckRankWatch(timeout_s=600, grace_s=20, stop_asked=lambda: state["stop"])  # type: ignore[arg-type, return-value]
    yield watch, state
    watch.close()


def test_stuck_after_a_stop_signal_for_the_grace(watch: tuple[StuckRankWatch, dict]) -> None:
    watcher, state = watch
    state["blocked"] = ("all_reduce: log interval totals", 100.0)
    watcher.check(500.0)  # blocked for long, but no stop asked and well within the timeout
    watcher.stop_at = (110.0, "SIGTERM")
    watcher.check(129.9)
    with pytest.raises(Ended) as ended:
        watcher.check(130.0)
    assert str(ended.value) == (
        "SIGTERM came 20 s ago and this rank is still blocked in all_reduce: log interval "
        "totals (for 30 s)"
    )


def test_the_grace_counts_from_entering_a_collective_after_the_stop(
    watch: tuple[StuckRankWatch, dict],
) -> None:
    """A rank that got back to Python after the signal (the graceful stop's own collectives)
    gets the whole grace for each collective it enters."""
    watcher, state = watch
    watcher.stop_at = (100.0, "the stop command")
    state["blocked"] = ("all_gather_object: RNG states and health", 115.0)
    watcher.check(134.0)
    state["blocked"] = None
    watcher.check(200.0)
    state["blocked"] = ("barrier: the run ends", 200.0)
    with pytest.raises(Ended, match=r"^the stop command came 120 s ago .* barrier: the run ends"):
        watcher.check(220.0)


def test_the_backstop_past_the_timeout(watch: tuple[StuckRankWatch, dict]) -> None:
    watcher, state = watch
    state["blocked"] = ("dcp.save: checkpoint shards", 0.0)
    watcher.check(600.0 + BACKSTOP_S - 0.1)
    with pytest.raises(Ended) as ended:
        watcher.check(600.0 + BACKSTOP_S)
    assert str(ended.value) == (
        "blocked in dcp.save: checkpoint shards for 630 s, past distributed.timeout (600 s)"
    )


def test_a_stop_signal_reaches_the_watch_while_the_main_thread_is_busy(
    watch: tuple[StuckRankWatch, dict],
) -> None:
    """The signal's wake-up byte reaches the watch thread without the main thread running
    Python (here: the handler only records it)."""
    watcher, _ = watch
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        signal.raise_signal(signal.SIGUSR1)
        deadline = threading.Event()
        for _ in range(200):
            if watcher.stop_at is not None:
                break
            deadline.wait(0.05)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert watcher.stop_at is not None and watcher.stop_at[1] == "SIGUSR1"
    assert received == [signal.SIGUSR1]


def test_the_collective_context_marks_the_thread_and_ends_the_rank_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines: list[str] = []
    monkeypatch.setattr(distributed, "end_rank", lambda why: lines.append(why))
    with distributed.collective("all_reduce: test"):
        what, _ = distributed.in_collective(threading.current_thread()) or ("", 0.0)
        assert what == "all_reduce: test"
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore")
    assert distributed.in_collective(threading.current_thread()) is None
    assert len(lines) == 1 and lines[0].startswith("all_reduce: test failed after 0 s (")
    assert lines[0].endswith("(RuntimeError: Connection closed by peer [127.0.0.1]:1234)")
