"""The drill catalog: each drill as data (what it does to a run of the demo's tiny GPT, whether
the run is supervised, what an operator says and when, when the drill has seen enough) and the
outcome lossguard should reach (docs/benchmarks.md, "Drill catalog").

The kinds of outcome:

- fine (fault-free, a level shift, a declared change): nothing rolled back, nobody paged, at most
  one informational message;
- fixed by lossguard (a skipped update that healed, a rollback or restart that worked): one
  Slack message per event or action, saying what happened and what was done; no page;
- needs a person (nothing to roll back to, an action that failed, rollbacks exhausted, a crash
  loop, a stalled run not restarted): exactly one PagerDuty incident per run and problem.

Runs are sized by the demo's :class:`Scenario` (``steps``: the step at which a drill's run is
judged; the fault comes at a third of it, checkpoints every 2/5 of that). The runner is
``tests/support/drill_runner.py``, the table ``benchmarks/bench_drills.py``."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lossguard.agent.config import FaultConfig, FaultKind
from lossguard.common.config import read_config_file
from lossguard.common.rundir.events import RESTART, ROLLBACK
from lossguard.ctl.cli import build_parser
from lossguard.monitor.actions.model import OPEN_STATES
from lossguard.monitor.demo.scenario import MONITOR_BASE, Scenario

Kind = Literal["fine", "fixed", "person"]
End = Literal["stop", "keep"]
SHIPPED_ACTIONS: dict[str, Any] = read_config_file(MONITOR_BASE)["actions"]
MAX_ATTEMPTS = int(SHIPPED_ACTIONS["rollback"]["max_attempts"])
SHIFT = 0.3  # the level shift's step up of the loss
BIG_SHIFT = 6.0  # one the demo's 25-std detector sees here (+3 is z 16: the window std is ~0.19)
WEIGHTS_BLOWUP = 1e30  # one update at this lr multiple leaves every later loss non-finite
STRETCH_STEPS = 1200  # a corrupt stretch: longer than LossSpikeNotRecovering's 300 steps + 1m
STRETCH_STEP_S = 0.1  # at most 10 steps a second through it, so the 1m is 600 steps at most
NOT_RECOVERING_STEPS = 300  # the shipped LossSpikeNotRecovering's episode length, then its 1m
ONE_NAN_SLOW_STEPS = 40  # the detector's 20 steps back in band, and the next snapshot
LASTING_NAN_STEPS = 200  # a lasting NaN, slowed to NAN_STEP_S: longer than the 30 s cooldown
NAN_STEP_S = 0.2
DEFAULT_DEADLINE_S = 900.0
# A run this many steps past its fault, nothing in flight, was not going to be acted on: the
# shipped LossSpikeNotRecovering is pending from 300 steps into an episode until it acts.
UNNOTICED_STEPS = 500


@dataclass(frozen=True)
class Knobs:
    """What a catalog run sets for every drill: the scale, and the slow drill's step time."""

    scale: Scenario
    slow_step_s: float = 3.0


# --------------------------------------------------------------------------- what was seen


@dataclass
class Observation:
    """What the runner has seen of a drill's run so far: its audit trail and metrics log, and
    the monitor's view (from its HTTP API)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)  # the run's, newest first
    alerts: list[dict[str, Any]] = field(default_factory=list)  # the run's, pending and firing
    run: dict[str, Any] | None = None

    def rollbacks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == ROLLBACK]

    def restarts(self, reason: str | None = None) -> list[dict[str, Any]]:
        """The supervisor's restarts (``reason``: crash or requested; None: both)."""
        return [
            e
            for e in self.events
            if e.get("event") == RESTART
            and e.get("source") == "supervisor"
            and (reason is None or e.get("reason") == reason)
        ]

    def rewound_at(self) -> float:
        """When the run last went back in steps: a rollback or a restart (0: never)."""
        return max((float(e["time"]) for e in self.rollbacks() + self.restarts()), default=0.0)

    def step(self) -> int | None:
        """The step of the newest train record."""
        steps = [r["step"] for r in self.records if r.get("kind") == "train"]
        return int(steps[-1]) if steps else None

    def open_actions(self) -> list[dict[str, Any]]:
        return [a for a in self.actions if a.get("state") in OPEN_STATES]

    def action_alerts(self) -> list[dict[str, Any]]:
        """The run's pending or firing alerts that ask the monitor for an action."""
        return [a for a in self.alerts if a.get("labels", {}).get("action")]

    @property
    def paused(self) -> bool:
        return bool(self.run and (self.run.get("paused") or self.run.get("status") == "paused"))

    @property
    def supervisor_state(self) -> str | None:
        supervisor = (self.run or {}).get("supervisor") or {}
        return supervisor.get("state")


# --------------------------------------------------------------------------- stop conditions


@dataclass(frozen=True)
class Reached:
    """The run evaluated at the judged step or later since it last went back, and nothing is
    in flight: no open action, no alert asking for one. ``past_fault``: the step must also be
    this many steps past the fault step (a fault that outlasts the judged step)."""

    past_fault: int = 0

    def step(self, scale: Scenario) -> int:
        return max(scale.steps, scale.fault_step + self.past_fault)

    def holds(self, seen: Observation, scale: Scenario) -> bool:
        since, step = seen.rewound_at(), self.step(scale)
        evaluated = any(
            r.get("kind") == "eval" and r["step"] >= step and r["time"] > since
            for r in seen.records
        )
        return evaluated and not seen.open_actions() and not seen.action_alerts()

    def __str__(self) -> str:
        where = f" (and {self.past_fault} past the fault)" if self.past_fault else ""
        return f"evaluated at the judged step{where}, nothing in flight"


@dataclass(frozen=True)
class Rollbacks:
    count: int

    def holds(self, seen: Observation, scale: Scenario) -> bool:
        return len(seen.rollbacks()) >= self.count

    def __str__(self) -> str:
        return f"{self.count} rollback{'s' * (self.count != 1)}"


@dataclass(frozen=True)
class Restarts:
    count: int

    def holds(self, seen: Observation, scale: Scenario) -> bool:
        return len(seen.restarts("requested")) >= self.count

    def __str__(self) -> str:
        return f"{self.count} requested restart{'s' * (self.count != 1)}"


@dataclass(frozen=True)
class Paused:
    def holds(self, seen: Observation, scale: Scenario) -> bool:
        return seen.paused

    def __str__(self) -> str:
        return "paused"


@dataclass(frozen=True)
class CrashLoop:
    def holds(self, seen: Observation, scale: Scenario) -> bool:
        return seen.supervisor_state == "crash_loop"

    def __str__(self) -> str:
        return "the supervisor in crash_loop"


@dataclass(frozen=True)
class Decided:
    """The monitor decided an action of the run (applied, failed, nothing to restore...)."""

    def holds(self, seen: Observation, scale: Scenario) -> bool:
        return any(a.get("state") not in OPEN_STATES for a in seen.actions)

    def __str__(self) -> str:
        return "an action decided"


@dataclass(frozen=True)
class All:
    parts: tuple[Stop, ...]

    def holds(self, seen: Observation, scale: Scenario) -> bool:
        return all(p.holds(seen, scale) for p in self.parts)

    def __str__(self) -> str:
        return " and ".join(map(str, self.parts))


@dataclass(frozen=True)
class AnyOf:
    parts: tuple[Stop, ...]

    def holds(self, seen: Observation, scale: Scenario) -> bool:
        return any(p.holds(seen, scale) for p in self.parts)

    def __str__(self) -> str:
        return " or ".join(map(str, self.parts))


Stop = Reached | Rollbacks | Restarts | Paused | CrashLoop | Decided | All | AnyOf


# --------------------------------------------------------------------------- outcomes


@dataclass(frozen=True)
class Count:
    """An inclusive range of counts (``high`` None: unbounded)."""

    low: int = 0
    high: int | None = None

    def holds(self, n: int) -> bool:
        return n >= self.low and (self.high is None or n <= self.high)

    def __str__(self) -> str:
        if self.high == self.low:
            return str(self.low)
        if self.high is None:
            return f"≥{self.low}"
        return f"≤{self.high}" if self.low == 0 else f"{self.low}-{self.high}"


def exactly(n: int) -> Count:
    return Count(n, n)


def at_most(n: int) -> Count:
    return Count(0, n)


def at_least(n: int) -> Count:
    return Count(n, None)


@dataclass
class Outcome:
    """What a drill's run came to. Rollbacks: rollbacks the monitor applied (its actions);
    Slack: the messages the Slack stand-in accepted; pages: PagerDuty incidents (distinct
    dedup_key of the accepted ``trigger`` events); steps lost: steps trained again (rollbacks'
    from - to, restarts' last logged step - resumed checkpoint), from events.jsonl; val: the
    last evaluation (step, loss) of the final timeline; reference: the fault-free run's at that
    step, same seed."""

    drill: str
    seed: int
    not_runnable: str | None = None
    error: str | None = None  # the harness failed (the row says so)
    rollbacks: int = 0
    slack: list[str] = field(default_factory=list)
    pages: list[str] = field(default_factory=list)
    pagerduty_events: int = 0
    restarts: int = 0
    paused: bool | None = None
    steps_lost: int = 0
    val: tuple[int, float] | None = None
    evals: dict[int, float] = field(default_factory=dict)
    reference: float | None = None
    actions: list[str] = field(default_factory=list)
    stop_met: bool = False
    settled: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    work: Path | None = None

    def summary(self) -> str:
        """The outcome on one line, for a failed assertion or a log."""
        parts = [
            f"rollbacks {self.rollbacks}",
            f"Slack {counted(self.slack)}",
            f"pages {counted(self.pages)}",
            f"restarts {self.restarts}",
            f"paused {self.paused}",
            f"steps lost {self.steps_lost}",
            f"val {self.val}",
            f"actions {self.actions}",
            *self.notes,
            f"files in {self.work}",
        ]
        return "; ".join(parts)

    @property
    def val_change(self) -> float | None:
        """The val loss relative to the fault-free run's (0.05: 5% higher)."""
        if self.val is None or self.reference is None:
            return None
        return self.val[1] / self.reference - 1.0


def counted(items: Sequence[str]) -> str:
    """``3: LossSpike x2, ActionTaken`` (in order of first appearance)."""
    if not items:
        return "0"
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    names = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items())
    return f"{len(items)}: {names}"


@dataclass(frozen=True)
class Expected:
    """The outcome a drill should reach; a None field is not judged."""

    kind: Kind
    rollbacks: Count | None = None
    slack: Count | None = None
    slack_per_rollback: bool = False  # as many Slack messages as rollbacks
    pages: Count | None = None
    restarts: Count | None = None
    paused: bool | None = None
    val_within: float | None = None  # final val loss within this share of the fault-free one

    def misses(self, outcome: Outcome) -> list[str]:
        """What in ``outcome`` is not as expected, in words (empty: it matches)."""
        found: list[str] = []
        checks = (
            ("rollbacks", self.rollbacks, outcome.rollbacks),
            ("Slack messages", self.slack, len(outcome.slack)),
            ("pages", self.pages, len(outcome.pages)),
            ("restarts", self.restarts, outcome.restarts),
        )
        for name, want, got in checks:
            if want is not None and not want.holds(got):
                found.append(f"{name} {got}, expected {want}")
        if self.slack_per_rollback and len(outcome.slack) != outcome.rollbacks:
            found.append(
                f"Slack messages {len(outcome.slack)}, expected one per rollback "
                f"({outcome.rollbacks})"
            )
        if self.paused is not None and outcome.paused != self.paused:
            found.append(f"paused {outcome.paused}, expected {self.paused}")
        if self.val_within is not None:
            change = outcome.val_change
            if change is None:
                found.append("no final val loss to compare with the fault-free run's")
            elif abs(change) > self.val_within:
                found.append(
                    f"val loss {change:+.1%} of fault-free, expected within ±{self.val_within:.0%}"
                )
        return found

    def __str__(self) -> str:
        parts = []
        if self.rollbacks is not None:
            parts.append(f"{self.rollbacks} rollbacks")
        if self.restarts is not None:
            parts.append(f"{self.restarts} restarts")
        if self.slack_per_rollback:
            parts.append("1 Slack per rollback")
        elif self.slack is not None:
            parts.append(f"{self.slack} Slack")
        if self.pages is not None:
            parts.append(f"{self.pages} pages")
        if self.paused:
            parts.append("paused")
        if self.val_within is not None:
            parts.append(f"val ±{self.val_within:.0%}")
        return ", ".join(parts)


# --------------------------------------------------------------------------- the drills


@dataclass(frozen=True)
class OperatorCommand:
    """``lossguard-ctl --run-dir RUN ARGS``, sent once the run has logged step ``at``."""

    at: Callable[[Scenario], int]
    args: tuple[str, ...]


@dataclass(frozen=True)
class Drill:
    name: str
    title: str  # what happens to the run, in words
    expected: Expected
    faults: Callable[[Knobs], list[dict[str, Any]]]
    sets: tuple[str, ...] = ()  # the agent's --set overrides, besides the catalog's
    supervised: bool = False  # under lossguard-supervise (its default options)
    commands: tuple[OperatorCommand, ...] = ()
    stop: Stop = Reached()
    deadline_s: Callable[[Knobs], float] = lambda knobs: DEFAULT_DEADLINE_S
    end: End = "stop"  # stop the run once the stop condition holds, or keep it as it is
    transient: tuple[str, ...] = ()  # fault kinds a restarted process does not meet again
    light: bool = False  # idle most of the time: runs beside the training slots
    long: bool = False  # ten minutes or more by design
    seeds: int = 1

    def problems(self, knobs: Knobs) -> list[str]:
        """Why this checkout cannot run the drill (empty: it can): a fault kind or field the
        agent does not have, a control command lossguard-ctl does not have."""
        found = []
        kinds = set(typing.get_args(FaultKind))
        for fault in self.faults(knobs):
            if fault["kind"] not in kinds:
                found.append(f"the agent has no fault kind {fault['kind']!r}")
            unknown = sorted(set(fault) - set(FaultConfig.model_fields))
            if unknown:
                found.append(f"faults have no field {', '.join(unknown)}")
        for command in self.commands:
            if command.args[0] not in ctl_commands():
                found.append(f"lossguard-ctl has no command {command.args[0]!r}")
        return found


def ctl_commands() -> set[str]:
    """The subcommands of ``lossguard-ctl``."""
    subparsers = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name for action in subparsers for name in action.choices}


def lasting(kind: str, knobs: Knobs, **fields: Any) -> dict[str, Any]:
    """A fault from the fault step to the end of the run."""
    start = knobs.scale.fault_step
    return {"kind": kind, "step": start, "duration": knobs.scale.max_steps - start, **fields}


def stretch(kind: str, knobs: Knobs, steps: int, **fields: Any) -> dict[str, Any]:
    """A transient fault over ``steps`` steps from the fault step."""
    return {
        "kind": kind,
        "step": knobs.scale.fault_step,
        "duration": steps,
        "once": True,
        **fields,
    }


def _declared_shift(knobs: Knobs) -> list[dict[str, Any]]:
    """A level shift, with the 20 steps before it slowed so that the operator's word lands
    before it."""
    k = knobs.scale.fault_step
    slow = {"kind": "slow_step", "step": k - 20, "duration": 20, "seconds": 0.5, "once": True}
    return [slow, lasting("loss_shift", knobs, amount=BIG_SHIFT)]


def _diverging(knobs: Knobs) -> list[dict[str, Any]]:
    """lr x1000 from the fault step on; from LossSpikeNotRecovering's 300 steps into the
    episode, the steps of its 1m slowed to STRETCH_STEP_S (as slower steps than a tiny CPU
    model's would be: the minute is waited out, not trained through at full speed)."""
    slow = {
        "kind": "slow_step",
        "step": knobs.scale.fault_step + NOT_RECOVERING_STEPS,
        "duration": 600,
        "seconds": STRETCH_STEP_S,
        "once": True,
    }
    return [lasting("lr_scale", knobs, factor=1000.0, once=True), slow]


def _slow_divergence_deadline(knobs: Knobs) -> float:
    """Every attempt: LossSpikeNotRecovering's 300 steps at the slow step time and its 1m."""
    attempt = 300 * knobs.slow_step_s * 1.25 + 150
    return (MAX_ATTEMPTS + 1) * attempt + 600


FINE = Expected("fine", rollbacks=exactly(0), slack=at_most(1), pages=exactly(0))

DRILLS: tuple[Drill, ...] = (
    Drill(
        "fault-free",
        "no fault",
        Expected("fine", rollbacks=exactly(0), slack=exactly(0), pages=exactly(0)),
        lambda knobs: [],
        seeds=3,
    ),
    Drill(
        "one-nan",
        f"one non-finite loss (the update is skipped), the {ONE_NAN_SLOW_STEPS} steps from it "
        f"slowed to {NAN_STEP_S:g} s (the monitor scrapes every second)",
        Expected("fixed", rollbacks=exactly(0), slack=at_most(1), pages=exactly(0)),
        lambda knobs: [
            stretch("nonfinite_loss", knobs, 1),
            stretch("slow_step", knobs, ONE_NAN_SLOW_STEPS, seconds=NAN_STEP_S),
        ],
    ),
    Drill(
        "lasting-nan",
        f"non-finite losses for {LASTING_NAN_STEPS} steps in a row ({NAN_STEP_S:g} s each)",
        Expected("fixed", rollbacks=at_least(1), slack_per_rollback=True, pages=exactly(0)),
        lambda knobs: [
            stretch("nonfinite_loss", knobs, LASTING_NAN_STEPS),
            stretch("slow_step", knobs, LASTING_NAN_STEPS, seconds=NAN_STEP_S),
        ],
    ),
    Drill(
        "nan-weights",
        f"one update at lr x{WEIGHTS_BLOWUP:g}: the weights blow up, every later loss is NaN",
        Expected("fixed", rollbacks=exactly(1), slack=exactly(1), pages=exactly(0)),
        lambda knobs: [stretch("lr_scale", knobs, 1, factor=WEIGHTS_BLOWUP)],
    ),
    Drill(
        "lr-x1000",
        f"lr x1000 from the fault step on (the run diverges); {NOT_RECOVERING_STEPS} steps into "
        f"the episode, steps slowed to {STRETCH_STEP_S:g} s for LossSpikeNotRecovering's 1m",
        Expected(
            "fixed", rollbacks=exactly(1), slack=exactly(1), pages=exactly(0), val_within=0.10
        ),
        _diverging,
        stop=AnyOf((All((Rollbacks(1), Reached())), Reached(past_fault=UNNOTICED_STEPS))),
    ),
    Drill(
        "level-shift",
        f"the loss steps up by {SHIFT:g} for good (loss_shift)",
        FINE,
        lambda knobs: [lasting("loss_shift", knobs, amount=SHIFT)],
    ),
    Drill(
        "level-shift-big",
        f"the loss steps up by {BIG_SHIFT:g} for good (loss_shift): a spike episode, then a level",
        FINE,
        lambda knobs: [lasting("loss_shift", knobs, amount=BIG_SHIFT)],
    ),
    Drill(
        "declared-change",
        f"the operator declares a data-mix change, then the loss steps up by {BIG_SHIFT:g}",
        FINE,
        _declared_shift,
        commands=(
            OperatorCommand(
                lambda scale: scale.fault_step - 20,
                ("expect-change", "--reason", "planned data-mix change (drill)"),
            ),
        ),
    ),
    Drill(
        "corrupt-batch",
        "one batch of uniform random tokens",
        Expected("fixed", rollbacks=at_most(1), pages=exactly(0)),
        lambda knobs: [stretch("corrupt_batch", knobs, 1)],
    ),
    Drill(
        "corrupt-stretch",
        f"{STRETCH_STEPS} batches of random tokens in a row ({STRETCH_STEP_S:g} s each)",
        Expected("fixed", rollbacks=at_least(1), pages=exactly(0)),
        lambda knobs: [
            stretch("corrupt_batch", knobs, STRETCH_STEPS),
            stretch("slow_step", knobs, STRETCH_STEPS, seconds=STRETCH_STEP_S),
        ],
        stop=AnyOf((All((Rollbacks(1), Reached())), Reached(past_fault=STRETCH_STEPS))),
    ),
    Drill(
        "slow-divergence",
        "lr x1000 from the fault step on, every time, at slow steps (--slow-step-s each)",
        Expected("person", rollbacks=exactly(MAX_ATTEMPTS), pages=exactly(1), paused=True),
        lambda knobs: [
            lasting("lr_scale", knobs, factor=1000.0),
            lasting("slow_step", knobs, seconds=knobs.slow_step_s),
        ],
        stop=AnyOf((Paused(), Rollbacks(MAX_ATTEMPTS + 1), Reached(past_fault=UNNOTICED_STEPS))),
        deadline_s=_slow_divergence_deadline,
        end="keep",
        light=True,
        long=True,
    ),
    Drill(
        "hang",
        "the training process hangs (under lossguard-supervise); a restarted one does not",
        Expected("fixed", restarts=exactly(1), pages=exactly(0)),
        lambda knobs: [{"kind": "hang", "step": knobs.scale.fault_step}],
        supervised=True,
        stop=All((Restarts(1), Reached())),
        deadline_s=lambda knobs: 1800.0,
        transient=("hang",),
        light=True,
        long=True,
    ),
    Drill(
        "crash-loop",
        "every start crashes at the fault step (under lossguard-supervise)",
        Expected("person", pages=exactly(1)),
        lambda knobs: [{"kind": "crash", "step": knobs.scale.fault_step}],
        supervised=True,
        stop=CrashLoop(),
        deadline_s=lambda knobs: 2700.0,
        end="keep",
        light=True,
        long=True,
    ),
    Drill(
        "nothing-to-restore",
        "lr x1000 from the fault step on, with no checkpoint or snapshot to go back to",
        Expected("person", rollbacks=exactly(0), pages=exactly(1)),
        lambda knobs: [
            stretch("lr_scale", knobs, knobs.scale.max_steps, factor=1000.0),
            lasting("slow_step", knobs, seconds=0.05),
        ],
        sets=("checkpoint.every=null", "checkpoint.every_seconds=null", "snapshot.every=null"),
        stop=Decided(),
        end="keep",
    ),
)
CATALOG: dict[str, Drill] = {d.name: d for d in DRILLS}


def select(names: Sequence[str] | None) -> list[Drill]:
    """The named drills in catalog order (all for None); KeyError names an unknown one."""
    if names is None:
        return list(DRILLS)
    unknown = [n for n in names if n not in CATALOG]
    if unknown:
        raise KeyError(f"unknown drill {unknown[0]!r}; drills: {', '.join(CATALOG)}")
    return [d for d in DRILLS if d.name in names]
