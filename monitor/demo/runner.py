"""Runs the demo: writes the scenario, starts the inbox, the monitor and the agent, shows what
happens, stops the run once it has recovered, then writes the report and tells the story."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from lossguard.common.config import seconds
from lossguard.common.control.client import ControlClient, ControlError, ControlUnavailable
from lossguard.common.rundir.events import ROLLBACK
from lossguard.common.rundir.paths import RunPaths
from lossguard.monitor.demo.inbox import Inbox
from lossguard.monitor.demo.scenario import (
    RUN_ID,
    DemoFiles,
    Fault,
    Receivers,
    Scenario,
    prepare,
    shipped_notifications,
    write_agent_config,
    write_monitor_config,
)
from lossguard.monitor.demo.summary import Places, Story, build_story, summary_lines
from lossguard.monitor.demo.view import LiveView, PlainView, View, use_plain
from lossguard.monitor.demo.watch import Happening, Watcher

POLL_S = 0.25
TIME_LIMIT_S = 900.0  # the story normally ends within minutes; a run that never recovers stops
SETTLE_MARGIN_S = 30.0  # beyond group_wait: delivery, and its retries
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DemoOptions:
    steps: int
    fault: Fault
    plain: bool
    out: Path | None
    overrides: tuple[str, ...] = ()


def default_out() -> Path:
    return Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")


def run_demo(
    options: DemoOptions,
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """The demo, start to end: 0 when the run was rolled back and recovered, 1 when not.
    ConfigError (before any process starts) for options or overrides that cannot work."""
    stream = sys.stdout if stream is None else stream
    environ = os.environ if environ is None else environ
    scenario = Scenario(options.steps, options.fault)
    scenario.check()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # ends the agent and the monitor too
    files = prepare(options.out or default_out())
    write_agent_config(files, scenario, options.overrides)
    receivers = Receivers.from_env(environ)
    inbox = Inbox(files.inbox) if receivers.any_local else None
    try:
        inbox_url = None if inbox is None else inbox.url
        write_monitor_config(files, receivers, inbox_url)
        view: View = (
            PlainView(stream)
            if use_plain(options.plain, stream, environ)
            else LiveView(stream, f"lossguard demo: run {RUN_ID}")
        )
        monitor_env = receivers.monitor_env(environ, inbox_url)
        demo = Demo(files, scenario, view, receivers, dict(environ), monitor_env)
        try:
            story = demo.run()
        finally:
            view.close()
    finally:
        if inbox is not None:
            inbox.close()
    places = demo.places(inbox is not None)
    messages = [] if inbox is None else inbox.messages()
    for line in summary_lines(story, places, messages):
        print(line, file=stream)
    if not story.recovered:
        print(f"\nThe story did not end as it should: {demo.problem or 'no recovery'}", file=stream)
    return 0 if story.recovered else 1


class Demo:
    """The processes and the watching, from start to the story."""

    def __init__(
        self,
        files: DemoFiles,
        scenario: Scenario,
        view: View,
        receivers: Receivers,
        agent_env: dict[str, str],
        monitor_env: dict[str, str],
    ) -> None:
        self.files = files
        self.scenario = scenario
        self.view = view
        self.receivers = receivers
        self.agent_env = agent_env
        self.monitor_env = monitor_env
        self.watcher = Watcher(files.run_dir, files.state_db)
        self.started = time.monotonic()
        self.problem: str | None = None
        self.stopped_by_demo = False
        self.report: Path | None = None
        self.report_problem: str | None = None
        self.group_wait = str(shipped_notifications()["route"]["group_wait"])

    def run(self) -> Story:
        self._tell_intro()
        monitor = _start(
            ["lossguard.monitor.cli", "run", "--config", str(self.files.monitor_config)],
            self.files.monitor_log,
            self.monitor_env,
        )
        agent = None
        try:
            agent = _start(
                ["lossguard.agent.cli", "run", str(self.files.agent_config), "--no-progress"],
                self.files.agent_log,
                self.agent_env,
            )
            self._watch(agent, monitor)
            self._settle(monitor)
        finally:
            if agent is not None:
                _end(agent)
            _end(monitor)
            self._poll()
            self.watcher.close()
        self._write_report()
        w = self.watcher
        return build_story(
            self.scenario.describe(),
            w.events,
            w.records,
            w.alerts,
            list(w.actions.values()),
            w.sent,
            self.stopped_by_demo,
        )

    def places(self, local_inbox: bool) -> Places:
        return Places(
            work=self.files.work,
            run_dir=self.files.run_dir,
            monitor_config=self.files.monitor_config,
            state_db=self.files.state_db,
            report=self.report,
            report_problem=self.report_problem,
            inbox=self.files.inbox if local_inbox else None,
        )

    # ------------------------------------------------------------------ phases

    def _tell_intro(self) -> None:
        slack = "Slack for real" if self.receivers.slack_real else "Slack to the local inbox"
        pager = (
            "PagerDuty for real"
            if self.receivers.pagerduty_real
            else "PagerDuty to the local inbox"
        )
        lines = [
            f"demo files in {self.files.work}",
            "agent: the tiny demo GPT (configs/demo.yaml, batches of 8) on CPU, on the Python "
            f"standard library's sources; fault: {self.scenario.describe()}",
            "monitor: the default rules (alerts/lossguard.rules.yml) and actions "
            f"(configs/monitor.yml), scraping and evaluating every second; {slack}, {pager}",
            "notifications as shipped (configs/monitor.yml, its routes uncommented): critical "
            "alerts to PagerDuty and Slack, warnings and announcements (what the monitor did) "
            f"to Slack, the rest to the monitor's log; group_wait {self.group_wait}",
            f"the demo stops the run once it sees an evaluation at or past step "
            f"{self.scenario.steps} after the rollback (the run may take a few more steps "
            "before the stop arrives)",
        ]
        self.view.tell([Happening(time.time(), "demo", line) for line in lines], 0.0)

    def _watch(self, agent: subprocess.Popen[bytes], monitor: subprocess.Popen[bytes]) -> None:
        """Until the agent ends: show what happens; stop the run once it has recovered, or at
        the time limit."""
        told_url = False
        while agent.poll() is None:
            self._poll()
            if not told_url and self.watcher.monitor_url is not None:
                told_url = True
                self._tell(f"monitor running: {self.watcher.monitor_url}/api/v1/alerts")
            if monitor.poll() is not None:
                self.problem = f"the monitor exited ({_last_line(self.files.monitor_log)})"
                return
            if not self.stopped_by_demo and self._recovered():
                self._stop_run("the run has recovered")
            elif not self.stopped_by_demo and self._elapsed() > TIME_LIMIT_S:
                self.problem = f"no recovery within {TIME_LIMIT_S:.0f} s"
                self._stop_run(self.problem)
            time.sleep(POLL_S)
        if not self.stopped_by_demo:
            self.problem = f"the agent exited by itself ({_last_line(self.files.agent_log)})"

    def _settle(self, monitor: subprocess.Popen[bytes]) -> None:
        """After the run: until every action the monitor applied has been announced
        (ActionTaken, flushed up to group_wait after it: the shipped 30 s) and the outbox is
        empty, within group_wait and a margin. Resolved alerts are not waited for: their group
        is told group_interval (5 minutes) after its last message."""
        deadline = time.monotonic() + settle_limit_s()
        while monitor.poll() is None and time.monotonic() < deadline:
            self._poll()
            if not self.watcher.unannounced() and self.watcher.outbox_pending() == 0:
                return
            time.sleep(POLL_S)
        waiting = [a.id for a in self.watcher.unannounced()]
        if waiting:
            self._tell(f"gave up waiting for the announcement of {', '.join(waiting)}")

    def _recovered(self) -> bool:
        """Rolled back and evaluated at or past ``steps`` since the last rollback."""
        rollbacks = [e for e in self.watcher.events if e.get("event") == ROLLBACK]
        if not rollbacks:
            return False
        since = rollbacks[-1]["time"]
        return any(
            r.get("kind") == "eval" and r["time"] > since and r["step"] >= self.scenario.steps
            for r in self.watcher.records
        )

    def _stop_run(self, why: str) -> None:
        self.stopped_by_demo = True
        self._tell(f"stopping the run: {why} (the stop command: save, exit)")
        try:
            with ControlClient(
                socket_path=RunPaths.of(self.files.run_dir).socket, timeout=STOP_TIMEOUT_S
            ) as client:
                client.request("stop", request_id="demo-stop")
        except (ControlError, ControlUnavailable, OSError) as exc:
            self._tell(f"the stop command failed ({exc}); ending the agent")

    def _write_report(self) -> None:
        from lossguard.monitor.report import ReportError, write_report

        try:
            files = write_report(self.files.run_dir, self.files.work, state_db=self.files.state_db)
        except ReportError as exc:
            self.report_problem = str(exc)
        else:
            self.report = files.html

    # ------------------------------------------------------------------ helpers

    def _poll(self) -> None:
        happenings = self.watcher.poll()
        self.view.tell(happenings, self._elapsed())
        self.view.show(self.watcher.status, self.watcher.firing(), self._elapsed())

    def _tell(self, text: str) -> None:
        self.view.tell([Happening(time.time(), "demo", text)], self._elapsed())

    def _elapsed(self) -> float:
        return time.monotonic() - self.started


def settle_limit_s() -> float:
    """How long the demo waits after the run for the announcements: the longest group_wait
    of the shipped routes, and a margin."""
    route = shipped_notifications()["route"]
    waits = [route["group_wait"], *(r["group_wait"] for r in route["routes"] if "group_wait" in r)]
    return max(seconds(w) for w in waits) + SETTLE_MARGIN_S


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _start(module_args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``python -m MODULE ARGS`` with its output to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", *module_args], stdout=out, stderr=subprocess.STDOUT, env=env
        )


def _end(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (both save or close cleanly on it), then SIGKILL if it does not end."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "nothing logged"
