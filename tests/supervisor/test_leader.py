"""Node 0's side of multi-node supervision: when its own group ended the run, the followers'
groups get time to end on their own before they are told to end (told at once, a group still
exiting would be cut short and counted as a crash); after a crash they are told at once."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from lossguard.supervisor.leader import Leader
from lossguard.supervisor.multinode import Coordination, NodeReport

pytestmark = pytest.mark.live


def running_follower(coordination: Coordination, leader: Leader, generation: int) -> NodeReport:
    report = NodeReport(
        node=1, leader=leader.decision.leader, hostname="h", pid=1, generation=generation
    )
    coordination.report(report)
    return report


def test_a_follower_ending_on_its_own_within_the_grace_is_not_told_to_end(tmp_path: Path) -> None:
    coordination = Coordination(tmp_path)
    leader = Leader(coordination, nnodes=2)
    leader.publish("run", generation=1)
    report = running_follower(coordination, leader, 1)
    waits: list[float] = []

    def wait(seconds: float) -> bool:  # the follower's torchrun exits during the second wait
        waits.append(seconds)
        if len(waits) == 2:
            ended = dataclasses.replace(report, status=0, code=0, ended_at=time.time())
            coordination.report(ended)
        return False

    ended = leader.end_all(1, 60.0, wait, grace_s=60.0)
    assert ended[1] is not None and ended[1].code == 0
    assert leader.decision.action == "run"  # never told to end
    assert len(waits) == 2


def test_without_grace_followers_are_told_to_end_and_a_silent_one_is_a_crash(
    tmp_path: Path,
) -> None:
    coordination = Coordination(tmp_path)
    leader = Leader(coordination, nnodes=2)
    leader.publish("run", generation=1)
    running_follower(coordination, leader, 1)
    started = time.monotonic()
    ended = leader.end_all(1, 0.3, lambda s: False)
    assert ended == {1: None}
    assert (leader.decision.action, leader.decision.generation) == ("end", 1)
    assert time.monotonic() - started < 30
