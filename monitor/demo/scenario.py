"""The demo's scenario: the agent's config (the tiny demo GPT of ``configs/demo.yaml`` with an
injected divergence) and the monitor's (``configs/monitor.yml``: the default rules and
actions), written into the demo's folder. Slack and PagerDuty get the real messages when their
environment variables are set; otherwise the monitor sends them to the demo's local inbox."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from lossguard.common.config import ConfigError, read_config_file
from lossguard.monitor.config import load_monitor_config

REPO = Path(__file__).resolve().parents[2]
AGENT_BASE = REPO / "configs" / "demo.yaml"
MONITOR_BASE = REPO / "configs" / "monitor.yml"
SLACK_ENV = "LOSSGUARD_SLACK_WEBHOOK_URL"
PAGERDUTY_ENV = "LOSSGUARD_PAGERDUTY_ROUTING_KEY"
STAND_IN_ROUTING_KEY = "demo-routing-key".ljust(32, "0")  # PagerDuty keys have 32 characters
RUN_ID = "tiny-gpt"
LR_FACTOR = 1000.0
LOG_EVERY = 5
SPIKE_ZSCORE = 25.0
CAP_PER_STEP = 100  # the run's max_steps per --steps: the demo stops it long before
# --fault nan: NaN losses for the 40 steps LossNonFinite waits for, so that its episode reaches
# them at the last NaN and every NaN step lies before the rollback (a ``once`` fault perturbs a
# step again after a rollback only past the step the run had reached). The detector ends the
# episode on the 20th finite step after them, and LossNonFinite with it: those steps are slowed,
# so that the monitor (1 s scrape and evaluation) sees the episode at 40 steps before it ends,
# and rolls back before it reaches LossSpike's 50 (5 s). The demo waits for the announcement
# (group_wait, 30 s) longer than the slowed steps take.
NAN_STEPS = 40
NAN_SLOW_STEPS = 20
NAN_SLOW_STEP_S = 0.5
DEMO_BATCH_SIZE = 8
Fault = Literal["lr", "nan"]
MIN_STEPS: dict[Fault, int] = {"lr": 120, "nan": 30}


@dataclass(frozen=True)
class Scenario:
    """``steps``: the demo stops the recovered run once it sees an evaluation at or past
    this step. The fault comes at a third of it; checkpoints every 2/5 of that, so the last good
    checkpoint lies before the fault."""

    steps: int = 300
    fault: Fault = "lr"

    @property
    def fault_step(self) -> int:
        return self.steps // 3

    @property
    def checkpoint_every(self) -> int:
        return max(2, 2 * self.fault_step // 5)

    @property
    def eval_every(self) -> int:
        return max(1, self.fault_step // 2)

    @property
    def max_steps(self) -> int:
        return self.steps * CAP_PER_STEP

    def check(self) -> None:
        """ConfigError naming the option when the scenario cannot tell its story."""
        least = MIN_STEPS[self.fault]
        if self.steps < least:
            before = (
                "a checkpoint"
                if self.fault == "nan"
                else "the spike detector's 32 steps of history and a checkpoint"
            )
            raise ConfigError(
                f"--steps: at least {least} with --fault {self.fault}, not {self.steps} (the "
                f"fault comes at a third of the run, after {before})"
            )

    def faults(self) -> list[dict[str, Any]]:
        """The agent's ``faults:`` list, each transient (``once``): the steps replayed after the
        rollback are not perturbed again (steps past the one the run had reached would be: the
        NaN steps all lie before the rollback, and the demo stops the run long before the step
        the lr fault's run was rolled back from)."""
        if self.fault == "nan":
            return [
                {
                    "kind": "nonfinite_loss",
                    "step": self.fault_step,
                    "duration": NAN_STEPS,
                    "once": True,
                },
                {
                    "kind": "slow_step",
                    "step": self.fault_step + NAN_STEPS,
                    "duration": NAN_SLOW_STEPS,
                    "seconds": NAN_SLOW_STEP_S,
                    "once": True,
                },
            ]
        duration = self.max_steps - self.fault_step
        return [
            {
                "kind": "lr_scale",
                "step": self.fault_step,
                "duration": duration,
                "factor": LR_FACTOR,
                "once": True,
            }
        ]

    def describe(self) -> str:
        if self.fault == "nan":
            last = self.fault_step + NAN_STEPS - 1
            return (
                f"NaN losses from step {self.fault_step} to {last} ({NAN_STEPS} steps, as many "
                f"as LossNonFinite waits for; the {NAN_SLOW_STEPS} steps after them slowed to "
                f"{NAN_SLOW_STEP_S:g} s, so that the monitor sees the episode before it ends)"
            )
        return f"the learning rate multiplied by {LR_FACTOR:g} from step {self.fault_step} on"


@dataclass(frozen=True)
class DemoFiles:
    """Where the demo writes: its folder ``work`` and the paths in it."""

    work: Path

    @property
    def agent_config(self) -> Path:
        return self.work / "agent.yaml"

    @property
    def monitor_config(self) -> Path:
        return self.work / "monitor.yml"

    @property
    def run_dir(self) -> Path:
        return self.work / RUN_ID

    @property
    def state_db(self) -> Path:
        return self.work / "monitor-state" / "state.db"

    @property
    def inbox(self) -> Path:
        return self.work / "inbox.jsonl"

    @property
    def agent_log(self) -> Path:
        return self.work / "agent.log"

    @property
    def monitor_log(self) -> Path:
        return self.work / "monitor.log"


@dataclass(frozen=True)
class Receivers:
    """Which services get the real messages (their variable is set) and which the inbox."""

    slack_real: bool
    pagerduty_real: bool

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Receivers:
        return cls(bool(environ.get(SLACK_ENV)), bool(environ.get(PAGERDUTY_ENV)))

    @property
    def any_local(self) -> bool:
        return not (self.slack_real and self.pagerduty_real)

    def monitor_env(self, environ: Mapping[str, str], inbox_url: str | None) -> dict[str, str]:
        """The monitor's environment: the real variables where set, else the inbox's URL and
        a stand-in routing key."""
        env = dict(environ)
        if not self.slack_real:
            env[SLACK_ENV] = f"{inbox_url}/slack"
        if not self.pagerduty_real:
            env[PAGERDUTY_ENV] = STAND_IN_ROUTING_KEY
        return env


def prepare(work: Path) -> DemoFiles:
    """The demo's folder, created; ConfigError when it exists and is not empty. Absolute: the
    configs written into it name their paths, which a relative folder would double."""
    work = work.resolve()
    if work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise ConfigError(f"--out: {work} exists and is not an empty folder; name a new one")
    work.mkdir(parents=True, exist_ok=True)
    return DemoFiles(work)


def write_agent_config(
    files: DemoFiles, scenario: Scenario, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """``agent.yaml``: configs/demo.yaml with the scenario, then ``overrides`` (``--set``),
    resolved and validated by ``lossguard-agent check`` (ConfigError naming the key); returns
    it resolved."""
    settings = read_config_file(AGENT_BASE)
    sections: dict[str, dict[str, Any]] = {
        "run": {"dir": str(files.work), "id": RUN_ID, "device": "cpu"},
        "train": {
            "max_steps": scenario.max_steps,
            "schedule": "constant",  # the run is stopped long before max_steps
            # half the demo config's batch: twice the steps a second, so that the shipped
            # rule's 300-step episode (and the whole story) takes half the time
            "batch_size": DEMO_BATCH_SIZE,
            "eval_every": scenario.eval_every,
            "log_every": LOG_EVERY,
        },
        "checkpoint": {"every": scenario.checkpoint_every},
        "telemetry": {"host": "127.0.0.1", "port": 0, "spikes": {"zscore": SPIKE_ZSCORE}},
    }
    for name, values in sections.items():
        settings[name] = {**settings.get(name, {}), **values}
    settings["faults"] = scenario.faults()
    files.agent_config.write_text(yaml.safe_dump(settings, sort_keys=False))
    sets = [f"--set={override}" for override in overrides]
    checked = subprocess.run(
        [sys.executable, "-m", "lossguard.agent.cli", "check", str(files.agent_config), *sets],
        capture_output=True,
        text=True,
        check=False,
    )
    if checked.returncode != 0:
        lines = checked.stderr.strip().splitlines() or [f"exit status {checked.returncode}"]
        raise ConfigError(lines[-1].removeprefix("lossguard-agent: error: "))
    files.agent_config.write_text(checked.stdout)
    resolved: dict[str, Any] = yaml.safe_load(checked.stdout)
    return resolved


def write_monitor_config(files: DemoFiles, receivers: Receivers, inbox_url: str | None) -> None:
    """``monitor.yml``: configs/monitor.yml (rules, actions, routes, timers, inhibition) watching
    the demo's folder, listening on a free port, with its Slack and PagerDuty receivers and
    routes uncommented (:func:`shipped_notifications`)."""
    settings = read_config_file(MONITOR_BASE)
    base = MONITOR_BASE.parent
    settings["rules"]["files"] = [str((base / f).resolve()) for f in settings["rules"]["files"]]
    settings["scrape"] = {**settings["scrape"], "runs_root": str(files.work)}
    settings["state"] = {"path": str(files.state_db)}
    settings["listen"] = {**settings["listen"], "port": 0}
    pagerduty_url = None if receivers.pagerduty_real else f"{inbox_url}/v2/enqueue"
    settings["notifications"] = shipped_notifications(pagerduty_url)
    settings["notifications"].pop("dashboard_url", None)  # no Grafana in the demo
    files.monitor_config.write_text(yaml.safe_dump(settings, sort_keys=False))
    load_monitor_config(files.monitor_config)  # ConfigError naming the key


def shipped_notifications(pagerduty_url: str | None = None) -> dict[str, Any]:
    """configs/monitor.yml's ``notifications`` with the receivers and routes it ships
    commented out (they need secrets) uncommented: ``oncall-pager`` (PagerDuty, the routing key
    from $LOSSGUARD_PAGERDUTY_ROUTING_KEY, its events API at ``pagerduty_url`` when given) and
    ``team-slack`` (the webhook URL from $LOSSGUARD_SLACK_WEBHOOK_URL); every timer as shipped."""
    text = MONITOR_BASE.read_text()
    notifications: dict[str, Any] = yaml.safe_load(text)["notifications"]
    pagerduty: dict[str, Any] = {"routing_key_env": PAGERDUTY_ENV}
    if pagerduty_url is not None:
        pagerduty["url"] = pagerduty_url
    notifications["receivers"] = [
        *notifications["receivers"],
        {"name": "oncall-pager", "pagerduty_configs": [pagerduty]},
        {"name": "team-slack", "slack_configs": [{"api_url_env": SLACK_ENV}]},
    ]
    notifications["route"]["routes"] = _commented_routes(text)
    return notifications


def _commented_routes(text: str) -> list[dict[str, Any]]:
    """The ``# routes:`` block of configs/monitor.yml, uncommented."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# routes:")
    block = []
    for line in lines[start + 1 :]:
        if not line.strip().startswith("#   - "):
            break
        block.append(line.strip().removeprefix("#").strip())
    routes: list[dict[str, Any]] = yaml.safe_load("\n".join(block))
    return routes
