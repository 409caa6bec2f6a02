"""Node 0's side of multi-node supervision (``multinode``): it publishes every decision and
reads the other nodes' reports."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable

from lossguard.supervisor.multinode import (
    HEARTBEAT_S,
    Action,
    Coordination,
    Decision,
    NodeReport,
)


class Leader:
    """Publishes node 0's decisions and watches the followers of one leader process."""

    def __init__(
        self, coordination: Coordination, nnodes: int, control_tcp: str | None = None
    ) -> None:
        """``control_tcp``: node 0's advertised TCP control address, carried by every
        decision so that every node's command is told it."""
        self.coordination = coordination
        self.nnodes = nnodes
        self.decision = Decision(
            leader=uuid.uuid4().hex, beat=0, generation=0, action="join", control_tcp=control_tcp
        )
        self._beaten = 0.0
        self._publish(self.decision)

    def _publish(self, decision: Decision) -> None:
        self.decision = decision
        self._beaten = time.monotonic()
        self.coordination.write_decision(decision)

    def publish(
        self,
        action: Action,
        *,
        generation: int | None = None,
        resume_from: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        d = self.decision
        self._publish(
            Decision(
                leader=d.leader,
                beat=d.beat + 1,
                generation=d.generation if generation is None else generation,
                action=action,
                resume_from=resume_from,
                exit_code=exit_code,
                control_tcp=d.control_tcp,
            )
        )

    def beat(self) -> None:
        """Rewrite the decision with a new ``beat`` when one is due (the followers' sign of
        life of the leader)."""
        if time.monotonic() - self._beaten >= HEARTBEAT_S:
            self._publish(dataclasses.replace(self.decision, beat=self.decision.beat + 1))

    def reports(self) -> dict[int, NodeReport]:
        return self.coordination.reports(self.decision.leader, self.nnodes)

    def wait_joined(self, timeout_s: float, wait: Callable[[float], bool]) -> bool:
        """Wait until every follower has joined; ``wait(s)`` sleeps (serving commands) and says
        whether to give up (a stop signal). Whether all joined."""
        deadline = time.monotonic() + timeout_s
        while len(self.reports()) < self.nnodes - 1:
            if time.monotonic() >= deadline or wait(0.2):
                return False
            self.beat()
        return True

    def crashed_node(self, generation: int) -> int | None:
        """A follower whose group of ``generation`` crashed (None: none has)."""
        for node, report in sorted(self.reports().items()):
            ended = report.generation == generation and report.status is not None
            if ended and report.code is None:
                return node
        return None

    def end_all(
        self,
        generation: int,
        timeout_s: float,
        wait: Callable[[float], bool],
        *,
        grace_s: float = 0.0,
    ) -> dict[int, NodeReport | None]:
        """End every follower's group of ``generation`` and wait until each has reported how
        it ended. Their reports by node (None: silent past ``timeout_s``, which counts as a
        crash). ``grace_s``: first give the followers that long to end on their own (node 0's
        group ended the run, so theirs are ending too: told to end now, one still exiting
        would be cut short and counted as a crash)."""
        ended = self._ended(generation, grace_s, wait)
        if len(ended) < self.nnodes - 1:
            self.publish("end", generation=generation)
            ended = self._ended(generation, timeout_s, wait)
        silent = {n: None for n in range(1, self.nnodes) if n not in ended}
        return {**ended, **silent}

    def _ended(
        self, generation: int, timeout_s: float, wait: Callable[[float], bool]
    ) -> dict[int, NodeReport]:
        """The followers' reports of how their group of ``generation`` ended, once all have
        one or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            ended = {
                node: report
                for node, report in self.reports().items()
                if report.generation == generation and report.status is not None
            }
            if len(ended) == self.nnodes - 1 or time.monotonic() >= deadline:
                return ended
            wait(0.1)
            self.beat()
