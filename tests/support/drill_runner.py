"""Runs the drills of tests/support/drill_catalog.py with real processes: per drill, Slack and
PagerDuty stand-ins (tests/support/fake_receivers.py) on 127.0.0.1, a monitor with the shipped
configs/monitor.yml (its commented-out ``oncall-pager`` and ``team-slack`` receivers and routes
uncommented, pointed at the stand-ins; only paths, the listen port and receivers changed) and the
agent (the demo's tiny GPT, configs/demo.yaml scaled down with ``--set``), alone or under
lossguard-supervise.

A drill runs until its stop condition holds or its deadline passes, ends its run (or keeps it,
as a person would find it), then waits until the monitor has told everything it will tell:
nothing in its outbox and no change for the longest group_wait or group_interval of its routes
(and, for an ended run, none of its alerts left). The outcome is read from what the stand-ins
accepted, the monitor's HTTP API and /metrics, and the run's events.jsonl and metrics.jsonl;
never from log text."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from lossguard.agent.config import SpikeConfig
from lossguard.common.config import seconds
from lossguard.common.control.client import ControlClient, ControlError, ControlUnavailable
from lossguard.common.rundir.events import CRASH, FAULT
from lossguard.common.rundir.jsonl import JsonlFollower
from lossguard.common.rundir.names import EVENTS_LOG, METRICS_LOG, SOCKET_NAME
from lossguard.monitor.config import load_monitor_config
from lossguard.monitor.demo.scenario import (
    MONITOR_BASE,
    RUN_ID,
    DemoFiles,
    Scenario,
    prepare,
    write_agent_config,
)
from tests.support.drill_catalog import Drill, Knobs, Observation, Outcome
from tests.support.fake_receivers import FakePagerDuty, FakeSlack
from tests.support.processes import free_port, start_monitor, stop_process

POLL_S = 0.5
SETTLE_POLL_S = 2.0
MONITOR_UP_S = 60.0
END_TIMEOUT_S = 120.0
API_TIMEOUT_S = 10.0
SETTLE_LIMIT_S = 1800.0  # a group_interval (5m) after an alert's last change, and more
FIRST_SEED = 1337  # configs/demo.yaml's
# the demo's model scaled down as tests/monitor/demo/test_demo.py does, evaluated on 8 batches
SCALED_DOWN = (
    "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64",
    "train.batch_size=8", "train.eval_batches=8", "data.max_bytes=400000",
    # the agent's shipped spike threshold, not the demo's 25 std (a demo-only setting under
    # which a noisy divergence joins the detector's window and ends its own episode)
    f"telemetry.spikes.zscore={SpikeConfig().zscore}",
)  # fmt: skip
ANNOUNCE_LABEL = "announce"
EXAMPLE = re.compile(r"^(?P<indent>\s*)# (?P<body>(?:- name:|routes:).*)$")
SLACK_TEXT = re.compile(r"^\[(?P<state>[A-Z]+)(?::\d+)?\]\s+(?P<name>\S+)")


class DrillSetupError(Exception):
    """The shipped configuration cannot be turned into a drill's."""


@dataclass(frozen=True)
class Options:
    steps: int = 600  # the judged step: the fault at a third of it
    slow_step_s: float = Knobs.slow_step_s
    settle_limit_s: float = SETTLE_LIMIT_S
    jobs: int = 2  # drills training at once (light drills run beside them)
    seeds: int | None = None  # seeds per drill; None: each drill's own count
    sets: tuple[str, ...] = ()  # more agent --set overrides, for every drill


@dataclass(frozen=True)
class DrillScenario(Scenario):
    """The demo's scenario with a drill's faults instead of the demo's."""

    planned: tuple[dict[str, Any], ...] = ()

    def faults(self) -> list[dict[str, Any]]:
        return [dict(f) for f in self.planned]


# --------------------------------------------------------------------------- the monitor's config


def uncomment_examples(text: str) -> str:
    """``text`` with its commented-out receivers and routes (a ``# - name:`` or ``# routes:``
    line and the more indented comment lines under it) uncommented."""
    out: list[str] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        found = EXAMPLE.match(lines[i])
        if found is None:
            out.append(lines[i])
            i += 1
            continue
        indent = found["indent"]
        out.append(f"{indent}{found['body']}\n")
        under = re.compile(rf"^{re.escape(indent)}# (?P<body>\s+\S.*)$")
        i += 1
        while i < len(lines) and (more := under.match(lines[i])) is not None:
            out.append(f"{indent}{more['body']}\n")
            i += 1
    return "".join(out)


def shipped_with_receivers(path: Path = MONITOR_BASE) -> dict[str, Any]:
    """The shipped monitor config with its example receivers and routes uncommented; checks
    that nothing else changed and that a PagerDuty and a Slack receiver are routed to."""
    text = path.read_text()
    shipped = yaml.safe_load(text)
    filled = yaml.safe_load(uncomment_examples(text))
    notifications = filled.get("notifications", {})
    names = {r["name"] for r in shipped.get("notifications", {}).get("receivers", [])}
    back = yaml.safe_load(yaml.safe_dump(filled))
    back_notifications = back.get("notifications", {})
    back_notifications["receivers"] = [
        r for r in back_notifications.get("receivers", []) if r["name"] in names
    ]
    if "routes" not in shipped.get("notifications", {}).get("route", {}):
        back_notifications.get("route", {}).pop("routes", None)
    if back != shipped:
        raise DrillSetupError(f"{path}: uncommenting its examples changed more than receivers")
    kinds = {k for r in notifications.get("receivers", []) for k in r if k.endswith("_configs")}
    if not {"pagerduty_configs", "slack_configs"} <= kinds:
        raise DrillSetupError(f"{path}: no PagerDuty and Slack receivers, commented out or not")
    if not notifications.get("route", {}).get("routes"):
        raise DrillSetupError(f"{path}: no routes to its receivers, commented out or not")
    return filled


def monitor_settings(
    work: Path, port: int, slack: FakeSlack, pagerduty: FakePagerDuty
) -> tuple[dict[str, Any], dict[str, str]]:
    """The drill's monitor config and the environment its receivers read: the shipped config
    (rules, routes, group timers, inhibition, actions as they are) watching ``work``, its
    state there, listening on ``port``, PagerDuty and Slack receivers at the stand-ins."""
    settings = shipped_with_receivers()
    base = MONITOR_BASE.parent
    settings["rules"]["files"] = [str((base / f).resolve()) for f in settings["rules"]["files"]]
    settings["scrape"]["runs_root"] = str(work)
    settings["state"]["path"] = str(work / "monitor-state" / "state.db")
    settings["listen"]["port"] = port
    env: dict[str, str] = {}
    for receiver in settings["notifications"]["receivers"]:
        for config in receiver.get("pagerduty_configs", []):
            config["url"] = pagerduty.enqueue_url
            env[config["routing_key_env"]] = pagerduty.routing_key
        for config in receiver.get("slack_configs", []):
            env[config["api_url_env"]] = slack.webhook_url
    return settings, env


def quiet_window_s(settings: dict[str, Any]) -> float:
    """How long after the last change every group has been flushed: the longest group_wait or
    group_interval of the route tree (children inherit), plus two evaluation intervals."""

    def longest(route: dict[str, Any], wait: str, interval: str) -> float:
        wait = route.get("group_wait", wait)
        interval = route.get("group_interval", interval)
        own = max(seconds(wait), seconds(interval))
        return max([own, *(longest(r, wait, interval) for r in route.get("routes", []))])

    route = settings.get("notifications", {}).get("route", {})
    evaluation = seconds(settings["rules"].get("evaluation_interval", "1m"))
    return longest(route, "30s", "5m") + 2 * evaluation + 2.0


# --------------------------------------------------------------------------- one drill


class DrillRun:
    """One drill at one seed in its own folder ``work``; :meth:`run` gives its outcome."""

    def __init__(
        self,
        drill: Drill,
        seed: int,
        knobs: Knobs,
        work: Path,
        cache: Path,
        slot: contextlib.AbstractContextManager[Any],
        settle_limit_s: float,
        sets: Sequence[str] = (),
    ) -> None:
        self.drill = drill
        self.seed = seed
        self.knobs = knobs
        self.cache = cache
        self.slot = slot
        self.settle_limit_s = settle_limit_s
        self.sets = tuple(sets)
        self.files = DemoFiles(work)
        self.outcome = Outcome(drill.name, seed, work=work)
        self.seen = Observation()
        self.api = ""
        self.quiet_s = 0.0
        self.activity: tuple[Any, ...] = ()
        self.active_since: float | None = None  # monotonic time of the last change, if any
        self.outbox_pending = 0
        self._events = JsonlFollower(self.files.run_dir / EVENTS_LOG)
        self._metrics = JsonlFollower(self.files.run_dir / METRICS_LOG)
        self._commands_sent: set[int] = set()
        self._dropped = False

    def run(self) -> Outcome:
        problems = self.drill.problems(self.knobs)
        if problems:
            self.outcome.not_runnable = "; ".join(problems)
            return self.outcome
        started = time.monotonic()
        prepare(self.files.work)
        with FakeSlack() as slack, FakePagerDuty() as pagerduty:
            process: subprocess.Popen[bytes] | None = None
            monitor: subprocess.Popen[str] | None = None
            try:
                with self.slot:
                    monitor = self._start_monitor(slack, pagerduty)
                    self._write_agent_config()
                    process = self._start_run()
                    self.outcome.stop_met = self._watch(process)
                    if self.drill.end == "stop":
                        self._end(process)
                self.outcome.settled = self._settle()
                self._collect(slack, pagerduty)
            finally:
                if process is not None:
                    self._end(process)
                if monitor is not None:
                    stop_process(monitor)
        self.outcome.seconds = time.monotonic() - started
        return self.outcome

    # ------------------------------------------------------------------ starting

    def _start_monitor(self, slack: FakeSlack, pagerduty: FakePagerDuty) -> subprocess.Popen[str]:
        port = free_port()
        settings, env = monitor_settings(self.files.work, port, slack, pagerduty)
        self.files.monitor_config.write_text(yaml.safe_dump(settings, sort_keys=False))
        load_monitor_config(self.files.monitor_config)  # ConfigError naming the key
        self.quiet_s = quiet_window_s(settings)
        self.api = f"http://127.0.0.1:{port}"
        monitor = start_monitor(self.files.monitor_config, env=env)
        deadline = time.monotonic() + MONITOR_UP_S
        while self._get("/api/v1/runs") is None:
            if monitor.poll() is not None or time.monotonic() > deadline:
                raise DrillSetupError(f"the monitor did not come up; see {monitor_log(self)}")
            time.sleep(POLL_S)
        return monitor

    def _write_agent_config(self) -> None:
        scale = self.knobs.scale
        scenario = DrillScenario(scale.steps, planned=tuple(self.drill.faults(self.knobs)))
        overrides = [
            *SCALED_DOWN,
            f"run.seed={self.seed}",
            f"data.cache_dir={self.cache}",
            *self.drill.sets,
            *self.sets,
        ]
        write_agent_config(self.files, scenario, overrides)

    def _start_run(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        agent = ["lossguard.agent.cli", "run", str(self.files.agent_config), "--no-progress"]
        if not self.drill.supervised:
            return launch(agent, self.files.agent_log, env)
        run_dir = str(self.files.run_dir)
        command = ["lossguard.supervisor.cli", "run", "--run-dir", run_dir, "--", sys.executable]
        return launch([*command, "-m", *agent], self.files.work / "supervisor.log", env)

    # ------------------------------------------------------------------ watching

    def _watch(self, process: subprocess.Popen[bytes]) -> bool:
        """Until the stop condition holds (True), the deadline passes or the process ends."""
        deadline = time.monotonic() + self.drill.deadline_s(self.knobs)
        while True:
            self._observe()
            self._operate()
            self._drop_transient()
            if self.drill.stop.holds(self.seen, self.knobs.scale):
                return True
            if process.poll() is not None:
                self._note(f"the run's process ended by itself (exit {process.returncode})")
                return False
            if time.monotonic() > deadline:
                limit = self.drill.deadline_s(self.knobs)
                self._note(f"stop condition ({self.drill.stop}) not met within {limit:.0f} s")
                return False
            time.sleep(POLL_S)

    def _observe(self) -> None:
        """Read what is new; note when anything the monitor tells or decides changed."""
        seen = self.seen
        seen.events += self._events.read()
        seen.records += self._metrics.read()
        actions = self._get("/api/v1/actions", run_id=RUN_ID, limit="1000")
        if actions is not None:
            seen.actions = actions["actions"]
        alerts = self._get("/api/v1/alerts")
        if alerts is not None:
            seen.alerts = [a for a in alerts["alerts"] if a["labels"].get("run_id") == RUN_ID]
        run = self._get(f"/api/v1/runs/{RUN_ID}")
        if run is not None:
            seen.run = run
        counters = self._counters()
        if counters is None:
            return
        self.outbox_pending = int(counters.get("lossguard_monitor_outbox_pending", 0))
        activity = (
            counters.get("lossguard_monitor_alert_transitions_total", 0),
            counters.get("lossguard_monitor_notifications_total", 0),
            tuple(sorted((a["fingerprint"], a["state"]) for a in seen.alerts)),
            tuple((a["id"], a["state"]) for a in seen.actions),
        )
        if activity != self.activity:
            if any(activity[:2]) or any(activity[2:]):
                self.active_since = time.monotonic()
            self.activity = activity

    def _operate(self) -> None:
        """Send the operator's commands whose step has come."""
        step = self.seen.step()
        for i, command in enumerate(self.drill.commands):
            if i in self._commands_sent or step is None or step < command.at(self.knobs.scale):
                continue
            self._commands_sent.add(i)
            done = subprocess.run(
                [
                    sys.executable, "-m", "lossguard.ctl.cli",
                    "--run-dir", str(self.files.run_dir), *command.args,
                ],
                capture_output=True, text=True, timeout=END_TIMEOUT_S, check=False,
            )  # fmt: skip
            said = (done.stdout + done.stderr).strip().splitlines()
            self._note(
                f"at step {step}: lossguard-ctl {' '.join(command.args)}: exit "
                f"{done.returncode}{f' ({said[-1]})' if said else ''}"
            )

    def _drop_transient(self) -> None:
        """Once a transient fault fired, take it out of the config a restart reads."""
        kinds = self.drill.transient
        if self._dropped or not kinds:
            return
        if not any(e.get("event") == FAULT and e.get("kind") in kinds for e in self.seen.events):
            return
        settings = yaml.safe_load(self.files.agent_config.read_text())
        settings["faults"] = [f for f in settings.get("faults", []) if f["kind"] not in kinds]
        self.files.agent_config.write_text(yaml.safe_dump(settings, sort_keys=False))
        self._dropped = True
        self._note(f"{', '.join(kinds)} fired: dropped from the config a restart reads")

    # ------------------------------------------------------------------ ending

    def _end(self, process: subprocess.Popen[bytes]) -> None:
        """End the run: the agent's stop command (a save, then exit), or SIGTERM to the
        supervisor (passed on as that); killed if it does not end."""
        if process.poll() is not None:
            return
        if not self.drill.supervised:
            with contextlib.suppress(ControlError, ControlUnavailable, OSError):
                socket_path = self.files.run_dir / SOCKET_NAME
                with ControlClient(socket_path=socket_path, timeout=END_TIMEOUT_S) as client:
                    client.request("stop", request_id="drill-stop")
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(END_TIMEOUT_S)
        stop_process(process, END_TIMEOUT_S)

    def _settle(self) -> bool:
        """Until the monitor has nothing left to tell: its outbox empty, nothing changed for
        the quiet window, and (for an ended run) none of its alerts left but announcements
        (told once, never as resolved); False at the limit."""
        deadline = time.monotonic() + self.settle_limit_s
        while True:
            self._observe()
            now = time.monotonic()
            quiet = self.active_since is None or now - self.active_since >= self.quiet_s
            left = [a for a in self.seen.alerts if not told_once(a)]
            over = self.drill.end == "keep" or not left
            if self.outbox_pending == 0 and quiet and over:
                return True
            if now > deadline:
                self._note(f"not settled within {self.settle_limit_s:.0f} s")
                return False
            time.sleep(SETTLE_POLL_S)

    # ------------------------------------------------------------------ the outcome

    def _collect(self, slack: FakeSlack, pagerduty: FakePagerDuty) -> None:
        outcome, seen = self.outcome, self.seen
        applied = [a for a in seen.actions if a["kind"] == "rollback" and a["state"] == "applied"]
        outcome.rollbacks = len(applied)
        outcome.actions = [f"{a['kind']} {a['state']}" for a in reversed(seen.actions)]
        outcome.slack = [slack_line(m.body) for m in slack.messages]
        events = [e.body for e in pagerduty.events]
        keep_bodies(self.files.work / "slack.jsonl", [m.body for m in slack.messages])
        keep_bodies(self.files.work / "pagerduty.jsonl", events)
        outcome.pagerduty_events = len(events)
        incidents: dict[str, str] = {}
        for event in events:
            if event.get("event_action") == "trigger":
                payload = event.get("payload") or {}
                name = payload.get("class") or str(payload.get("summary", ""))[:40]
                incidents.setdefault(str(event.get("dedup_key")), str(name))
        outcome.pages = list(incidents.values())
        outcome.restarts = len(seen.restarts("requested"))
        outcome.paused = seen.paused
        outcome.steps_lost = steps_lost(seen)
        evals = [r for r in seen.records if r.get("kind") == "eval"]
        outcome.evals = {int(r["step"]): float(r["val_loss"]) for r in evals}
        if evals:
            outcome.val = (int(evals[-1]["step"]), float(evals[-1]["val_loss"]))
        if len(seen.rollbacks()) != outcome.rollbacks:
            self._note(f"events.jsonl has {len(seen.rollbacks())} rollbacks")

    def _note(self, text: str) -> None:
        self.outcome.notes.append(text)

    def _get(self, path: str, **params: str) -> dict[str, Any] | None:
        """The ``data`` of a monitor API answer; None when it has none (yet)."""
        try:
            reply = requests.get(f"{self.api}{path}", params=params, timeout=API_TIMEOUT_S)
        except requests.RequestException:
            return None
        if reply.status_code != 200:
            return None
        data: dict[str, Any] = reply.json()["data"]
        return data

    def _counters(self) -> dict[str, float] | None:
        """The monitor's own series from /metrics, each summed over its labels (None: no
        answer)."""
        try:
            reply = requests.get(f"{self.api}/metrics", timeout=API_TIMEOUT_S)
        except requests.RequestException:
            return None
        if reply.status_code != 200:
            return None
        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        return sums


def launch(module_args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``python -m MODULE ARGS``, its output to ``log`` (a run of an hour fills no pipe)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", *module_args], stdout=out, stderr=subprocess.STDOUT, env=env
        )


def monitor_log(run: DrillRun) -> Path:
    return run.files.monitor_config.with_suffix(".log")


def told_once(alert: dict[str, Any]) -> bool:
    """An announcement (configs/monitor.yml: ``announce="once"``, never told as resolved)."""
    return bool(alert.get("labels", {}).get(ANNOUNCE_LABEL))


def keep_bodies(path: Path, bodies: Sequence[dict[str, Any]]) -> None:
    """What a stand-in accepted, one JSON body a line, for a person to read."""
    path.write_text("".join(json.dumps(body) + "\n" for body in bodies))


def slack_line(body: dict[str, Any]) -> str:
    """A Slack message in a few words: its alert and whether it says resolved."""
    text = str(body.get("text", ""))
    found = SLACK_TEXT.match(text)
    if found is None:
        return text[:40]
    resolved = " resolved" if found["state"] == "RESOLVED" else ""
    return f"{found['name']}{resolved}"


def steps_lost(seen: Observation) -> int:
    """Steps trained again: each rollback's from - to; each restart's last logged step (the
    crash's, else the last train record before it) - the step it resumed from."""
    lost = sum(int(e["from_step"]) - int(e["to_step"]) for e in seen.rollbacks())
    for restart in seen.restarts():
        resumed = restart.get("resume_from") or ""
        found = re.search(r"(\d+)$", resumed)
        before = [
            r["step"]
            for r in seen.records
            if r.get("kind") == "train" and r["time"] < restart["time"]
        ]
        crashes = [
            e for e in seen.events if e.get("event") == CRASH and e["time"] <= restart["time"]
        ]
        reached = crashes[-1].get("step") if crashes and restart.get("reason") == "crash" else None
        last = reached if isinstance(reached, int) else (before[-1] if before else 0)
        lost += max(0, last - (int(found[1]) if found else 0))
    return lost


# --------------------------------------------------------------------------- the catalog


def seeds_of(drill: Drill, options: Options) -> list[int]:
    count = drill.seeds if options.seeds is None else options.seeds
    return [FIRST_SEED + i for i in range(count)]


def run_catalog(
    drills: Sequence[Drill],
    options: Options,
    work: Path,
    reference: Drill,
    told: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Every drill at its seeds (and ``reference``, the fault-free drill, at every seed used,
    for the val loss), ``options.jobs`` training at once, started in the order given; ``told``
    hears of each as it ends. The outcomes in that order, with their reference val loss."""
    knobs = Knobs(Scenario(options.steps), options.slow_step_s)
    jobs = [(d, seed) for d in drills for seed in seeds_of(d, options)]
    used = {seed for _, seed in jobs}
    covered = {seed for d, seed in jobs if d is reference}
    jobs += [(reference, seed) for seed in sorted(used - covered)]
    cache = work / "cache"
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    slots = threading.BoundedSemaphore(options.jobs)

    def one(drill: Drill, seed: int) -> Outcome:
        slot: contextlib.AbstractContextManager[Any] = (
            contextlib.nullcontext() if drill.light else slots
        )
        folder = work / f"{drill.name}-{seed}"
        run = DrillRun(
            drill, seed, knobs, folder, cache, slot, options.settle_limit_s, options.sets
        )
        try:
            outcome = run.run()
        except Exception as exc:  # one drill's failure is its row
            outcome = run.outcome
            outcome.error = f"{type(exc).__name__}: {exc}"
        if told is not None:
            told(outcome)
        return outcome

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        outcomes = list(pool.map(lambda job: one(*job), jobs))
    references = {o.seed: o for o in outcomes if o.drill == reference.name}
    for outcome in outcomes:
        ref = references.get(outcome.seed)
        if ref is not None and outcome.val is not None:
            outcome.reference = ref.evals.get(outcome.val[0])
    return outcomes


@contextlib.contextmanager
def catalog_folder(keep: Path | None, prefix: str = "lossguard-drills-") -> Iterator[Path]:
    """``keep`` (created), or a temporary folder removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep.resolve()
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield Path(folder)
