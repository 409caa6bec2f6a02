"""The supervisor loop: start the training command, and when it dies, restart it from its
newest healthy checkpoint, within a budget; forward a stop signal and never restart after one;
restart a hung run when the monitor asks (``restart`` on ``supervisor.sock``, or with
``--control-tcp`` over TCP behind the agent's token gate).

It judges only process liveness and the monitor's requests, never training health. Every crash
and restart is an audit record in the run's ``events.jsonl`` (written while no training process
runs, or after the requested restart ended it) and a ``lossguard_supervisor_*`` series.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lossguard.common import __version__
from lossguard.common.config import ConfigError
from lossguard.common.control.address import advertised_address, join_address
from lossguard.common.control.protocol import SUPERVISOR_COMMAND_ARGS, ok_reply
from lossguard.common.control.server import (
    ControlServer,
    ListenError,
    PendingCommand,
    answered_before,
)
from lossguard.common.exitcodes import EXIT_PERMANENT, EXIT_RETRYABLE, EXIT_STOPPED
from lossguard.common.ownership import shared_file_mode
from lossguard.common.rundir.directory import RunDirectory
from lossguard.common.rundir.events import (
    COMMAND,
    CRASH,
    CRASH_LOOP,
    RESTART,
    SUPERVISOR_EXIT,
    SUPERVISOR_START,
)
from lossguard.common.rundir.files import write_atomically
from lossguard.common.rundir.paths import RunPaths
from lossguard.common.rundir.supervisor_file import (
    SupervisorInfo,
    SupervisorState,
    pid_alive,
)
from lossguard.supervisor.budget import RestartBudget
from lossguard.supervisor.leader import Leader
from lossguard.supervisor.metrics import SupervisorMetrics
from lossguard.supervisor.multinode import Coordination
from lossguard.supervisor.outcome import child_outcome, combined
from lossguard.supervisor.process import (
    TrainingProcess,
    command_env,
    describe_status,
    end_leftover_group,
    forward_stop,
)
from lossguard.supervisor.resume import ResumePlanner, step_reached
from lossguard.supervisor.tree import become_subreaper, end_orphans

log = logging.getLogger("lossguard.supervisor")
POLL_S = 0.2
END_GRACE_S = 15.0
"""When node 0's group ended the run (completed, stopped, preempted): how long the other
nodes' groups get to end on their own before they are told to end (torchrun's exit barrier
lets node 0's end only after every node's workers are done, so theirs end moments later)."""


class SupervisorError(RuntimeError):
    """The supervisor cannot start (one line)."""


@dataclass(frozen=True)
class TcpControl:
    """Serve the control over TCP too, behind the token gate: listen on ``bind`` (port 0: any
    free one) and tell others ``advertise`` (``HOST:PORT``; None: the bound address, a
    wildcard host as this host's name)."""

    bind: tuple[str, int]
    token: str = field(repr=False)
    advertise: str | None = None


@dataclass(frozen=True)
class SupervisorOptions:
    run_dir: Path
    command: tuple[str, ...]
    run_id: str
    max_restarts: int = 10
    window_s: float = 3600.0
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    kill_after_s: float = 30.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 0  # None: no exporter
    nnodes: int = 1  # this supervisor leads them (it is node 0)
    join_timeout_s: float = 600.0
    give_up: bool = False  # exit (permanent failure) when the restart budget is spent
    term_is_preemption: bool = False  # SIGTERM is forwarded as SIGUSR1 (Kubernetes)
    control_tcp: TcpControl | None = None  # None: the Unix socket only


class Supervisor:
    """Keeps one run's training command alive; ``run()`` returns the exit status to end with."""

    def __init__(self, options: SupervisorOptions) -> None:
        self.options = options
        self.run_dir = options.run_dir
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.events = RunDirectory(self.run_dir).events  # 0700 when made; another's refused
        self.budget = RestartBudget(
            options.max_restarts, options.window_s, options.backoff_s, options.backoff_max_s
        )
        self.planner = ResumePlanner(self.run_dir)
        self.metrics = SupervisorMetrics(options.run_id)
        self.metrics.set_remaining(options.max_restarts)
        self.stop_signal: int | None = None
        self._wake = threading.Event()
        self.child: TrainingProcess | None = None
        self.info = SupervisorInfo(
            run_id=options.run_id,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            started_at=time.time(),
            state="running",
            version=__version__,
        )
        self.server: ControlServer | None = None
        self.leader: Leader | None = None
        self.generation = 0
        self.ended_at = 0.0  # when the last start's command was seen to end

    # ------------------------------------------------------------------------------ the loop

    def run(self) -> int:
        become_subreaper()
        self._end_leftovers()
        self._start_services()
        self._install_signals()
        self.event(
            SUPERVISOR_START,
            pid=os.getpid(),
            command=list(self.options.command),
            control_tcp=self.info.control_tcp,
        )
        try:
            if self.options.nnodes > 1 and not self._lead():
                return self._finish(None, EXIT_STOPPED if self.stop_signal else EXIT_RETRYABLE)
            return self._loop()
        finally:
            if self.server is not None:
                self.server.close()
            self.events.close()

    def _loop(self) -> int:
        reason = "start"
        while True:
            resume = self.planner.choose()
            if reason != "start":
                self.metrics.restarted(reason)
                self.event(
                    RESTART,
                    reason=reason,
                    resume_from=resume.name if resume else None,
                    restarts_remaining=self.budget.remaining(time.time()),
                )
            self._start(resume.name if resume else None, restarted=reason != "start")
            status, requested, node = self._watch()
            code, node = self._outcome(status, node)
            if requested is not None:
                self._answer_restart(requested, status)
                reason = "requested"
                continue
            if code is not None:
                return self._finish(status, code)
            if self.stop_signal is not None:
                return self._finish(status, EXIT_RETRYABLE)
            code = self._crashed(status, node)
            if code is not None:
                return self._finish(status, code)
            reason = "crash"

    def _lead(self) -> bool:
        """Node 0 of several: wait for every other node to join; whether they did."""
        self.leader = Leader(Coordination(self.run_dir), self.options.nnodes, self.info.control_tcp)
        log.info("waiting for %d more nodes to join", self.options.nnodes - 1)
        joined = self.leader.wait_joined(self.options.join_timeout_s, self._idle)
        if not joined and self.stop_signal is None:
            log.error(
                "only %d of %d nodes joined within %.0f s",
                len(self.leader.reports()) + 1,
                self.options.nnodes,
                self.options.join_timeout_s,
            )
        return joined

    def _idle(self, timeout: float) -> bool:
        """Serve commands for ``timeout`` (restart requests wait); whether a stop signal came."""
        for pending in self._commands(timeout):
            pending.resolve(self._refuse_restart(pending))
        return self.stop_signal is not None

    def _outcome(self, status: int, node: int | None) -> tuple[int | None, int | None]:
        """The run's exit code for this start (None: a crash) and the node that crashed first.
        With followers, every node's group is ended first and their outcomes combined."""
        assert self.child is not None
        left = end_orphans()
        if left:
            log.warning("ended %d processes the training command left behind", len(left))
        own = child_outcome(status, self.run_dir, self.child.started_at)
        if self.leader is None:
            return own, None
        timeout = self.options.kill_after_s + 60
        grace = END_GRACE_S if own is not None else 0.0  # ours ended the run: theirs are ending
        others = self.leader.end_all(self.generation, timeout, self._idle, grace_s=grace)
        codes = {n: r.code if r is not None else None for n, r in others.items()}
        if node is None:  # our group ended first, or we saw it first: who crashed first?
            crashed = [(r.ended_at or 0.0, n) for n, r in others.items() if r and r.code is None]
            if own is None:
                crashed.append((self.ended_at, 0))
            node = min(crashed)[1] if crashed else None
        return combined([own, *codes.values()]), node

    def _start(self, resume: str | None, *, restarted: bool) -> None:
        self.generation += 1
        if self.leader is not None:
            self.leader.publish("run", generation=self.generation, resume_from=resume)
        env = command_env(resume, self.info.control_tcp)
        self.child = TrainingProcess(self.options.command, env)
        log.info("started pid %d%s", self.child.pid, f", resuming from {resume}" if resume else "")
        restarts = self.info.restarts + restarted
        self._set_state("running", child_pid=self.child.pid, restarts=restarts)

    def _watch(self) -> tuple[int, PendingCommand | None, int | None]:
        """Wait for the child to exit, for a restart request, or for another node's group to
        crash (the last two end our group first). The exit status, the request, the node."""
        assert self.child is not None
        while True:
            status = self.child.poll()
            if status is not None:
                self.ended_at = time.time()
                return status, None, None
            crashed = self.leader.crashed_node(self.generation) if self.leader else None
            if crashed is not None:
                log.warning("node %d's group crashed: ending ours", crashed)
                return self.child.end_group(self.options.kill_after_s), None, crashed
            for pending in self._commands(POLL_S):
                if pending.request.cmd == "restart" and self.stop_signal is None:
                    log.warning("restart requested: %s", pending.request.args["reason"])
                    return self.child.end_group(self.options.kill_after_s), pending, None
                pending.resolve(self._refuse_restart(pending))

    def _crashed(self, status: int, node: int | None) -> int | None:
        """Record a crash (of ``node``'s group first, with several nodes); None when the run
        is restarted (after the backoff), else the exit code to end with."""
        assert self.child is not None
        step = step_reached(self.run_dir)
        repeated = self.planner.crashed(step)
        delay = self.budget.take(time.time())
        resume = self.planner.choose() if delay is not None else None
        exit = describe_status(status)
        self.metrics.crashed(exit, step, resume.name if resume else None, node)
        self.metrics.set_remaining(self.budget.remaining(time.time()))
        self.event(
            CRASH,
            exit=exit,
            exit_status=status,
            node=node,
            step=step,
            repeated_at_same_step=repeated,
            stderr_tail=self.child.stderr_tail(),
            resume_from=resume.name if resume else None,
            restart_in_s=delay,
        )
        log.error("training command ended with %s at step %s", exit, step)
        if delay is None:
            return self._crash_loop()
        self._set_state("backoff", child_pid=None)
        return EXIT_STOPPED if self._sleep(delay) else None

    def _crash_loop(self) -> int | None:
        """The budget is spent: with ``give_up``, end (permanent failure); otherwise stay up
        (the page is the ``state`` series) until a human asks for a restart (None) or stops
        the supervisor."""
        opts = self.options
        self.event(CRASH_LOOP, max_restarts=opts.max_restarts, window_s=opts.window_s)
        log.error(
            "crash loop: %d restarts within %.0f s; not restarting (restart with: "
            "lossguard-supervise restart --run-dir %s)",
            opts.max_restarts,
            opts.window_s,
            self.run_dir,
        )
        self._set_state("crash_loop", child_pid=None)
        if opts.give_up:
            return EXIT_PERMANENT
        while self.stop_signal is None:
            for pending in self._commands(POLL_S):
                if pending.request.cmd == "restart":
                    self.budget.reset()
                    self.metrics.set_remaining(self.budget.remaining(time.time()))
                    self._record_answer(pending, {"restarting": True, "killed_pid": None})
                    return None
                pending.resolve(self._refuse_restart(pending))
        return EXIT_STOPPED

    def _sleep(self, delay: float) -> bool:
        """Wait out the backoff; whether a stop signal came meanwhile (a restart request
        cuts the wait short)."""
        deadline = time.monotonic() + delay
        while self.stop_signal is None and time.monotonic() < deadline:
            for pending in self._commands(min(POLL_S, max(0.0, deadline - time.monotonic()))):
                if pending.request.cmd == "restart":
                    self._record_answer(pending, {"restarting": True, "killed_pid": None})
                    return False
                pending.resolve(self._refuse_restart(pending))
        return self.stop_signal is not None

    def _finish(self, status: int | None, code: int) -> int:
        """End with ``code`` (the exit-code contract), every node with it."""
        how = describe_status(status) if status is not None else "not started"
        why = f"stop signal {signal.Signals(self.stop_signal).name}, " if self.stop_signal else ""
        self.event(SUPERVISOR_EXIT, exit=how, exit_code=code, stop_signal=bool(self.stop_signal))
        log.info("training command ended (%s%s); not restarting; exit %d", why, how, code)
        self._set_state("exited", child_pid=None)
        if self.leader is not None:
            self.leader.publish("exit", exit_code=code)
        return code

    # ----------------------------------------------------------------------- commands, files

    def _commands(self, timeout: float) -> list[PendingCommand]:
        if self.leader is not None:
            self.leader.beat()
        if self.server is None:
            self._wake.wait(timeout)
            self._wake.clear()
            return []
        taken = self.server.take(timeout)
        for pending in taken:
            if pending.request.cmd == "status":
                pending.resolve(ok_reply(pending.request.id, self.status()))
        return [p for p in taken if not p.done]

    def status(self) -> dict[str, Any]:
        return {
            "run_id": self.options.run_id,
            "state": self.info.state,
            "pid": os.getpid(),
            "child_pid": self.info.child_pid,
            "restarts": self.info.restarts,
            "restarts_remaining": self.budget.remaining(time.time()),
            "step": step_reached(self.run_dir),
        }

    def _refuse_restart(self, pending: PendingCommand) -> dict[str, Any]:
        return ok_reply(pending.request.id, {"restarting": False, "reason": "stopping"})

    def _answer_restart(self, pending: PendingCommand, status: int) -> None:
        assert self.child is not None
        self._record_answer(
            pending,
            {"restarting": True, "killed_pid": self.child.pid, "exit": describe_status(status)},
        )

    def _record_answer(self, pending: PendingCommand, result: dict[str, Any]) -> None:
        """Audit a restart request (its id is never applied twice, across our own restarts)
        and answer it."""
        request = pending.request
        self.event(
            COMMAND, id=request.id, cmd=request.cmd, args=request.args, ok=True, result=result
        )
        pending.resolve(ok_reply(request.id, result))

    def event(self, kind: str, /, **fields: Any) -> None:
        step = fields.pop("step", None)
        self.events.append(
            {"time": time.time(), "step": step, "event": kind, "source": "supervisor", **fields}
        )

    def _set_state(self, state: SupervisorState, **changes: Any) -> None:
        self.info = self.info.with_state(state, **changes)
        self.metrics.set_state(state)
        # as private as the run now (the agent applies run.mode after the supervisor starts)
        mode = shared_file_mode(self.run_dir)
        write_atomically(RunPaths.of(self.run_dir).supervisor, self.info.to_json(), mode=mode)

    def _start_services(self) -> None:
        """The control (socket, and TCP when asked for) and the exporter; a TCP listener that
        cannot start is a ConfigError naming ``--control-tcp``."""
        tcp = self.options.control_tcp
        try:
            self.server = ControlServer(
                socket_path=RunPaths.of(self.run_dir).supervisor_socket,
                tcp=tcp.bind if tcp is not None else None,
                token=tcp.token if tcp is not None else None,
                on_refused=self.metrics.control_refused,
                answered=answered_before(RunDirectory(self.run_dir).read_events()),
                commands=SUPERVISOR_COMMAND_ARGS,
            )
        except ListenError as exc:
            if exc.endpoint == "tcp":
                raise ConfigError(f"--control-tcp: {exc}") from None
            raise SupervisorError(f"control socket: {exc}") from None
        self.server.start()
        metrics_url = None
        if self.options.metrics_port is not None:
            port = self.metrics.serve(self.options.metrics_host, self.options.metrics_port)
            metrics_url = f"http://{self.options.metrics_host}:{port}/metrics"
        self.info = dataclasses.replace(
            self.info,
            socket=str(self.server.socket_path),
            metrics_url=metrics_url,
            control_tcp=self._advertised(),
        )

    def _advertised(self) -> str | None:
        """``HOST:PORT`` that others reach the TCP control at (None: not served)."""
        tcp = self.options.control_tcp
        bound = self.server.tcp_address if self.server is not None else None
        if tcp is None or bound is None:
            return None
        advertised = advertised_address(bound, tcp.advertise)
        log.info("control over TCP on %s, advertised as %s", join_address(*bound), advertised)
        return advertised

    def _end_leftovers(self) -> None:
        """Refuse to supervise a run another live supervisor here has; end the training process
        group that a killed supervisor left running (torchrun's workers outlive their parent)."""
        previous = SupervisorInfo.read(self.run_dir)
        if previous is None or previous.hostname != socket.gethostname():
            return
        if pid_alive(previous.pid):
            raise SupervisorError(
                f"supervisor pid {previous.pid} already supervises {self.run_dir}"
            )
        if previous.child_pid is not None and end_leftover_group(previous.child_pid):
            log.warning("ended process group %d left by a killed supervisor", previous.child_pid)

    def _install_signals(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        """Stop or preemption: forward the signal once (SIGTERM to the command, which saves
        and stops; SIGUSR1 to its whole group: the agent's ranks save and exit with the requeue
        code); never restart."""
        if self.stop_signal is not None:
            return
        self.stop_signal = signum
        if self.child is not None:
            forward_stop(self.child, signum, self.options.term_is_preemption)
        self._wake.set()
