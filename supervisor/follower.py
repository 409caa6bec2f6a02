"""A node other than node 0 (``multinode``): it runs its node's group only when the leader
says so, from the checkpoint the leader chose, ends it when the leader says so, and reports
how it ended; it decides nothing itself."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path

from lossguard.common.exitcodes import EXIT_RETRYABLE
from lossguard.common.rundir.supervisor_file import pid_alive
from lossguard.supervisor.multinode import Coordination, Decision, NodeReport
from lossguard.supervisor.outcome import child_outcome
from lossguard.supervisor.process import (
    TrainingProcess,
    command_env,
    end_leftover_group,
    forward_stop,
)
from lossguard.supervisor.tree import become_subreaper, end_orphans

log = logging.getLogger("lossguard.supervisor")
POLL_S = 0.1


class LeaderGone(Exception):
    """The leader's decision has not changed for the leader timeout, or a new leader took
    over."""


class Follower:
    def __init__(
        self,
        run_dir: Path,
        command: tuple[str, ...],
        node: int,
        leader_timeout_s: float,
        join_timeout_s: float,
        kill_after_s: float,
        term_is_preemption: bool = False,
    ) -> None:
        self.run_dir = run_dir
        self.command = command
        self.node = node
        self.leader_timeout_s = leader_timeout_s
        self.join_timeout_s = join_timeout_s
        self.kill_after_s = kill_after_s
        self.term_is_preemption = term_is_preemption
        self.coordination = Coordination(run_dir)
        self.child: TrainingProcess | None = None
        self.stop_signal: int | None = None
        self._seen: tuple[str, int] | None = None
        self._changed = time.monotonic()
        self.leader: str | None = None

    # ------------------------------------------------------------------ the leader's word

    def _decision(self, timeout_s: float | None = None) -> Decision | None:
        """The leader's current decision; LeaderGone when it changed, or stopped beating for
        ``timeout_s`` (default: the leader timeout)."""
        timeout_s = self.leader_timeout_s if timeout_s is None else timeout_s
        decision = self.coordination.decision()
        seen = (decision.leader, decision.beat) if decision is not None else None
        now = time.monotonic()
        if seen != self._seen:
            self._seen, self._changed = seen, now
            if decision is not None and self.leader not in (None, decision.leader):
                raise LeaderGone(f"a new leader {decision.leader} took over")
            return decision
        if now - self._changed > timeout_s:
            raise LeaderGone(f"no word from the leader for {timeout_s:.0f} s")
        return decision

    def _join(self) -> None:
        """Wait for a live leader (its decision changes while we watch), then join it."""
        first = self.coordination.decision()
        self._seen = (first.leader, first.beat) if first is not None else None
        while True:
            decision = self._decision(self.join_timeout_s)
            if decision is not None and (decision.leader, decision.beat) != (
                (first.leader, first.beat) if first is not None else None
            ):
                break
            if self.stop_signal is not None:
                raise LeaderGone("stopped before a leader was seen")
            time.sleep(POLL_S)
        self.leader = decision.leader
        self._report(generation=0)
        log.info("node %d joined leader %s", self.node, self.leader)

    def _report(
        self,
        generation: int,
        resume_from: str | None = None,
        child: TrainingProcess | None = None,
        status: int | None = None,
        code: int | None = None,
        ended_at: float | None = None,
    ) -> None:
        assert self.leader is not None
        report = NodeReport(
            node=self.node,
            leader=self.leader,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            generation=generation,
            resume_from=resume_from,
            child_pid=child.pid if child is not None else None,
            status=status,
            code=code,
            ended_at=ended_at,
        )
        self.coordination.report(report)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        become_subreaper()
        self._end_leftovers()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, self._on_stop_signal)
        try:
            self._join()
            return self._follow()
        except LeaderGone as exc:
            log.error("node %d: %s; ending", self.node, exc)
            if self.child is not None and self.child.poll() is None:
                self.child.end_group(self.kill_after_s)
            return EXIT_RETRYABLE

    def _follow(self) -> int:
        generation = 0
        while True:
            decision = self._decision()
            if decision is None or decision.generation <= generation:
                if decision is not None and decision.action == "exit":
                    return decision.exit_code if decision.exit_code is not None else 0
                time.sleep(POLL_S)
                continue
            if decision.action == "run":
                generation = decision.generation
                code = self._run_generation(decision)
                if self.stop_signal is not None:
                    return code if code is not None else EXIT_RETRYABLE
            else:
                time.sleep(POLL_S)

    def _run_generation(self, run: Decision) -> int | None:
        """Run the group of the generation that the leader's ``run`` decision starts, from
        the checkpoint it chose, telling the command node 0's TCP control address."""
        generation, resume = run.generation, run.resume_from
        child = self.child = TrainingProcess(self.command, command_env(resume, run.control_tcp))
        log.info(
            "node %d: generation %d, pid %d, from %s", self.node, generation, child.pid, resume
        )
        self._report(generation, resume, child)
        while (status := child.poll()) is None:
            decision = self._decision()
            if decision is not None and (decision.action, decision.generation) == (
                "end",
                generation,
            ):
                status = child.end_group(self.kill_after_s)
                break
            time.sleep(POLL_S)
        ended_at = time.time()
        end_orphans()
        code = child_outcome(status, self.run_dir, child.started_at)
        self._report(generation, resume, child, status, code, ended_at)
        return code

    def _end_leftovers(self) -> None:
        """End the group a killed supervisor of this node left running on this host."""
        previous = self.coordination.own_report(self.node)
        if previous is None or previous.hostname != socket.gethostname():
            return
        if pid_alive(previous.pid) and previous.pid != os.getpid():
            return  # not ours to end
        if previous.child_pid is not None and end_leftover_group(previous.child_pid):
            log.warning("ended process group %d left by a killed supervisor", previous.child_pid)

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        """Forward a stop (SIGTERM to the command) or preempt signal (SIGUSR1 to its group)."""
        if self.stop_signal is not None:
            return
        self.stop_signal = signum
        if self.child is not None:
            forward_stop(self.child, signum, self.term_is_preemption)
