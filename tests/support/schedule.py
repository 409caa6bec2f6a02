"""How scripts/test.sh spreads the suite over its four xdist workers (``--dist loadfile``): a
whole test file to a worker, so that a module's shared run (a fixture) is made once; but the
files that wait on wall-clock timers more than they compute (the shipped rules' ``for:``,
``group_wait``, retry back-offs) form two lanes, each one unit that two workers take from the
start, while the other two keep both cores busy with the live tests (they start processes);
the quick tests fill the end of the run."""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import Producer

# two lanes of about four minutes each (the drills 138 s, the monitor's own actions 119 s, ...:
# docs/benchmarks.md); while two workers wait on these timers, the cores have only the other
# two's live tests, as with three workers and one lane, so none of these runs on a CPU shared
# four ways; the lanes' workers then take live tests too
TIMER_LANES = (
    frozenset(
        {
            "tests/alerts/test_drills.py",
            "tests/monitor/actions/test_alertmanager_path.py",
            "tests/monitor/bench/test_bench.py",
            "tests/monitor/notify/test_chaos.py",
            "tests/monitor/notify/test_delivery.py",
        }
    ),
    frozenset(
        {
            "tests/deploy/test_slurm_live.py",
            "tests/monitor/actions/test_live.py",
            "tests/monitor/demo/test_demo.py",
            "tests/monitor/test_daemon.py",
        }
    ),
)


def timer_lane(path: str) -> int | None:
    """The lane of a test file on timers, or None."""
    return next((n for n, lane in enumerate(TIMER_LANES) if path in lane), None)


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def order(item: pytest.Item) -> int:
    """The files on timers first, then the live tests, then the rest."""
    if timer_lane(file_of(item.nodeid)) is not None:
        return 0
    return 1 if item.get_closest_marker("live") is not None else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=order)  # stable: each file's tests keep their order


class TimerLanes(LoadFileScheduling):
    """xdist's whole-file units, with each of ``TIMER_LANES`` one unit."""

    def _split_scope(self, nodeid: str) -> str:
        scope = super()._split_scope(nodeid)
        lane = timer_lane(scope)
        return scope if lane is None else f"timer lane {lane}"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    """``--dist loadfile`` gets ``TimerLanes``; any other mode is xdist's own."""
    return TimerLanes(config, log) if config.getvalue("dist") == "loadfile" else None
