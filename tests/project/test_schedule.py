"""scripts/test.sh's spread of the suite (tests/support/schedule.py): the timer lanes name test
files of this suite, each in one lane, and each lane is one xdist unit while every other file is
its own; the timer files come first, then the live ones, then the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.schedule import TIMER_LANES, TimerLanes, order

ROOT = Path(__file__).resolve().parents[2]


def test_each_timer_file_is_a_test_file_in_one_lane() -> None:
    files = [path for lane in TIMER_LANES for path in lane]
    assert len(files) == len(set(files))  # the lanes are disjoint
    for path in files:
        assert "\ndef test_" in (ROOT / path).read_text(), path


def test_a_lane_is_one_unit_and_any_other_file_its_own() -> None:
    scheduler = object.__new__(TimerLanes)  # _split_scope reads no state of its own
    first, second = (sorted(lane) for lane in TIMER_LANES)
    scopes = {path: scheduler._split_scope(f"{path}::test_x[a-b]") for path in first + second}
    assert {scopes[path] for path in first} == {"timer lane 0"}
    assert {scopes[path] for path in second} == {"timer lane 1"}
    other = "tests/agent/test_config.py"
    assert scheduler._split_scope(f"{other}::test_y") == other


def test_the_timer_files_come_first_then_the_live_ones(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    ranks = [order(item) for item in items]
    assert ranks == sorted(ranks)
    assert order(request.node) == 2  # this file starts no process
