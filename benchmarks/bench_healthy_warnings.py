"""Do the shipped warnings stay quiet on healthy runs? Fault-free training, scraped as the monitor
scrapes it, then the shipped rules evaluated over what was scraped by the monitor's evaluator.

    python -m benchmarks.bench_healthy_warnings [--models demo,wide] [--seeds 1,2,3] [--steps 2000]
        [--device cpu|cuda] [--scrape SECONDS] [--set KEY=VALUE]... [--keep DIR [--record-only]]
        [--replay DIR] [--rules FILE]

Each run trains configs/demo.yaml (``demo``: 4 layers of 128; ``wide``: 6 layers of 256) with
its seed for ``--steps`` steps, with nothing injected, on ``--device`` (the demo's cpu by
default). A scrape source of the monitor's own (lossguard.monitor.sources.scrape, discovering
the run under the runs folder) scrapes the agent every ``--scrape`` seconds (default 1, the
monitor's) and keeps everything; metrics.jsonl gives the spike detectors' episodes.

The rules file is then evaluated over the recording by the monitor's rule evaluator (RuleSet,
groups on their own interval), replayed at a pace of real training: each scrape moved to its
step (rank 0's lossguard_step then) times 1 s, evaluated every 15 s, and times 10 s, evaluated
every 60 s (Prometheus's default interval). A step on CPU takes a tenth of a second and on a
GPU a hundredth, so a rule that counts wall time would judge the recording at its own pace
otherwise than a real run; rules that count steps judge both paces alike. The scrapes must
come at least once per log interval (``train.log_every``, 10 steps) for the replay to hold
every exported value: ``--scrape`` below the time of 10 steps.

Prints a table per run: the spike detectors' episodes (from metrics.jsonl: how many, the most
that opened within any 500 steps; the longest as exported), and how many alerts of each
warning rule fired at 1 s / 10 s a step; alerts of other severities that fired are listed too.
``--keep DIR`` keeps the runs and their recordings (``--record-only``: no table); ``--replay
DIR`` judges the recordings kept in DIR (say with ``--rules`` of a candidate rules file)
without training. docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lossguard.monitor.promql import (
    STALE_NAN,
    Labels,
    Matcher,
    MemoryStorage,
    evaluate,
    is_stale,
)
from lossguard.monitor.promql.model import label_value
from lossguard.monitor.rules.alerting import TransitionKind
from lossguard.monitor.rules.rulefile import AlertingRule, load_rule_files
from lossguard.monitor.rules.ruleset import RuleSet, Schedule
from lossguard.monitor.sources.scrape import ScrapeSource

REPO = Path(__file__).resolve().parent.parent
SHIPPED_RULES = REPO / "alerts" / "lossguard.rules.yml"
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
MODELS: dict[str, tuple[str, ...]] = {
    "demo": (),
    "wide": ("model.n_layer=6", "model.n_embd=256"),
}
SCRAPE_S = 1.0
KEEP_ALL_S = 1e9  # the scrape source's retention: the whole run
PACES = ((1.0, 15.0), (10.0, 60.0))  # (seconds a step, evaluation interval) of the replays
EPISODE_WINDOW = 500  # steps, for "the most episodes within any 500 steps"
SIGNALS = ("loss", "grad_norm")
RECORDING = "recording.json"


@dataclass
class Recording:
    """A run as scraped: every series, each sample ``(t, value)`` with None for a staleness
    marker; and what its metrics.jsonl says of the spike detectors."""

    name: str
    model: str
    seed: int
    steps: int
    seconds: float
    series: dict[Labels, list[tuple[float, float | None]]]
    totals: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # (step, episodes)

    def storage(self, seconds_per_step: float) -> tuple[MemoryStorage, float, float]:
        """The samples as a storage, each scrape moved to its step (the run's lossguard_step
        then) times ``seconds_per_step``, with the first and last sample time."""
        retime = self._step_times(seconds_per_step)
        storage = MemoryStorage()
        times: list[float] = []
        for labels, samples in self.series.items():
            for t, value in samples:
                at = retime(t)
                if at is None:
                    continue
                storage.add(labels, at, STALE_NAN if value is None else value)
                times.append(at)
        return storage, min(times), max(times)

    def _step_times(self, seconds_per_step: float) -> Callable[[float], float | None]:
        """Scrape time -> the step rank 0 had then, times ``seconds_per_step`` (None before
        the first step is known)."""
        steps = sorted(
            (t, value)
            for labels, samples in self.series.items()
            if label_value(labels, "__name__") == "lossguard_step"
            and label_value(labels, "rank") == "0"
            for t, value in samples
            if value is not None
        )
        times = [t for t, _ in steps]

        def retime(t: float) -> float | None:
            index = bisect.bisect_right(times, t)
            return steps[index - 1][1] * seconds_per_step if index else None

        return retime

    def episodes(self, signal: str) -> int:
        return max((total for _, total in self.totals.get(signal, [])), default=0)

    def most_episodes_within(self, signal: str, steps: int) -> int:
        """The most episodes that opened within any ``steps`` consecutive steps."""
        totals = self.totals.get(signal, [])
        best = 0
        for step, total in totals:
            before = [t for s, t in totals if s <= step - steps]
            best = max(best, total - (before[-1] if before else 0))
        return best

    def longest_episode(self, signal: str) -> int:
        """The longest episode as exported (lossguard_spike_duration_steps, rank 0)."""
        return int(
            max(
                (
                    value
                    for labels, samples in self.series.items()
                    if label_value(labels, "__name__") == "lossguard_spike_duration_steps"
                    and label_value(labels, "signal") == signal
                    and label_value(labels, "rank") == "0"
                    for _, value in samples
                    if value is not None and math.isfinite(value)
                ),
                default=0,
            )
        )

    def save(self, path: Path) -> None:
        data = {
            "name": self.name,
            "model": self.model,
            "seed": self.seed,
            "steps": self.steps,
            "seconds": self.seconds,
            "totals": self.totals,
            "series": [[list(labels), samples] for labels, samples in self.series.items()],
        }
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> Recording:
        data = json.loads(path.read_text())
        series = {
            tuple((k, v) for k, v in labels): [(t, value) for t, value in samples]
            for labels, samples in data.pop("series")
        }
        totals = {k: [(s, t) for s, t in v] for k, v in data.pop("totals").items()}
        return cls(**data, series=series, totals=totals)


def train(
    config: Path,
    work: Path,
    name: str,
    *,
    model: str = "",
    seed: int,
    steps: int,
    settings: Sequence[str] = (),
    scrape_s: float = SCRAPE_S,
    env: Mapping[str, str] | None = None,
) -> Recording:
    """Train ``config`` as run ``name`` under ``work`` (its seed, ``steps`` steps, ``settings``
    as ``--set``, ``env`` added to the environment) while scraping it every ``scrape_s``; its
    recording."""
    argv = [sys.executable, "-m", "lossguard.agent.cli", "run", str(config), "--no-progress"]
    for setting in (
        f"run.dir={work}",
        f"run.id={name}",
        f"run.seed={seed}",
        f"train.max_steps={steps}",
        "telemetry.host=127.0.0.1",
        "telemetry.port=0",
        *settings,
    ):
        argv += ["--set", setting]
    source = ScrapeSource(
        static_targets=[], runs_root=work, interval_s=scrape_s, retention_s=KEEP_ALL_S
    )
    started = time.time()
    pace = threading.Event()  # never set: the scrape cadence
    with (work / f"{name}.log").open("w") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
        try:
            while process.poll() is None:
                source.scrape_once()
                pace.wait(scrape_s - time.time() % scrape_s)
            source.scrape_once()
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
            source.close()
    if process.returncode != 0:
        raise RuntimeError(f"run {name} failed (exit {process.returncode}): see {log.name}")
    series = {
        labels: [(t / 1000, None if is_stale(v) else v) for t, v in points]
        for labels, points in source.storage.select(
            [Matcher("__name__", "=~", ".+")], -math.inf, math.inf
        )
    }
    return Recording(
        name=name,
        model=model,
        seed=seed,
        steps=steps,
        seconds=time.time() - started,
        series=series,
        totals=_episode_totals(work / name / "metrics.jsonl"),
    )


def _episode_totals(metrics: Path) -> dict[str, list[tuple[int, int]]]:
    """Each signal's episodes so far at each logged step (metrics.jsonl's train records)."""
    totals: dict[str, list[tuple[int, int]]] = {signal: [] for signal in SIGNALS}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            for signal in SIGNALS:
                totals[signal].append((record["step"], record[f"{signal}_spikes_total"]))
    return totals


@dataclass(frozen=True)
class Verdict:
    """What the rules did over a recording: alerts fired per rule, and their severities."""

    fired: Counter[str]
    severity: dict[str, str]


def judge(recording: Recording, seconds_per_step: float, rules: Path = SHIPPED_RULES) -> Verdict:
    """Evaluate ``rules`` over the recording replayed at ``seconds_per_step`` as the monitor
    does (every ``PACES``' interval, groups with their own interval on it), counting the
    alerts that fired."""
    storage, start, end = recording.storage(seconds_per_step)
    groups = load_rule_files([rules])
    ruleset = RuleSet(groups)
    interval = dict(PACES)[seconds_per_step]
    schedule = Schedule(interval)

    def query(rule: AlertingRule, t: float) -> Any:
        return evaluate(rule.query or rule.expr, storage, t)

    def expr_query(expr: str, t: float) -> Any:
        return evaluate(expr, storage, t)

    fired: Counter[str] = Counter()
    t = math.ceil(start / interval) * interval
    while t <= end:
        due = schedule.due(groups, t)
        for change in ruleset.evaluate(
            query, t, groups=due, history_start=start, expr_query=expr_query
        ):
            if change.kind is TransitionKind.FIRING:
                fired[change.alert.labels["alertname"]] += 1
        schedule.done(groups, due, t)
        t += interval
    failed = [e.rule.name for e in ruleset.rules if e.last_error is not None]
    assert not failed, f"rules failed to evaluate: {failed}"
    severity = {e.rule.name: dict(e.rule.labels).get("severity", "") for e in ruleset.rules}
    return Verdict(fired, severity)


def _record_all(args: argparse.Namespace, work: Path) -> list[Recording]:
    recordings = []
    for model in args.models:
        for seed in args.seeds:
            name = f"{model}-s{seed}"
            recording = train(
                DEMO_CONFIG,
                work,
                name,
                model=model,
                seed=seed,
                steps=args.steps,
                settings=(*MODELS[model], f"run.device={args.device}", *args.set),
                scrape_s=args.scrape,
            )
            recording.save(work / f"{name}.{RECORDING}")
            recordings.append(recording)
    return recordings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scrape", type=float, default=SCRAPE_S, help="seconds between scrapes")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument("--keep", type=Path, help="keep the runs and recordings here")
    parser.add_argument("--record-only", action="store_true", help="with --keep: no table")
    parser.add_argument("--replay", type=Path, help="judge the recordings kept in this folder")
    parser.add_argument("--rules", type=Path, default=SHIPPED_RULES)
    args = parser.parse_args()
    if args.replay:
        recordings = [Recording.load(p) for p in sorted(args.replay.glob(f"*.{RECORDING}"))]
    elif args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        recordings = _record_all(args, args.keep.resolve())
        if args.record_only:
            return
    else:
        with tempfile.TemporaryDirectory(prefix="lossguard-healthy-") as work:
            recordings = _record_all(args, Path(work))
    print_table(recordings, args.rules)


SPIKE_WARNINGS = ("LossSpike", "GradNormSpike")


def print_table(recordings: list[Recording], rules: Path) -> None:
    verdicts = [[judge(r, pace, rules) for pace, _ in PACES] for r in recordings]
    severity = verdicts[0][0].severity if verdicts else {}
    paces = " / ".join(f"{pace:g} s" for pace, _ in PACES)
    table = Table(title=f"Healthy runs against {rules.name}: alerts fired at {paces} a step")
    for column in ("model", "seed", "steps", "s/step", "loss episodes", "grad-norm episodes"):
        table.add_column(column)
    for name in SPIKE_WARNINGS:
        table.add_column(name)
    table.add_column("other warnings fired")
    table.add_column("other alerts fired")
    for recording, judged in zip(recordings, verdicts, strict=True):
        cells = [
            recording.model,
            str(recording.seed),
            str(recording.steps),
            f"{recording.seconds / recording.steps:.3f}",
            *(
                f"{recording.episodes(s)} (≤{recording.most_episodes_within(s, EPISODE_WINDOW)}"
                f"/{EPISODE_WINDOW} steps, longest {recording.longest_episode(s)})"
                for s in SIGNALS
            ),
            *(" / ".join(str(v.fired[name]) for v in judged) for name in SPIKE_WARNINGS),
        ]
        fired = sorted({n for v in judged for n in v.fired if n not in SPIKE_WARNINGS})
        for warning in (True, False):
            named = [n for n in fired if (severity.get(n) == "warning") == warning]
            cells.append(
                ", ".join(f"{n} " + " / ".join(str(v.fired[n]) for v in judged) for n in named)
                or "none"
            )
        table.add_row(*cells)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
