"""Detection-to-recovery and recovery quality, with real processes on CPU.

    python -m benchmarks.bench_recovery [--only detection|alertmanager|quality] [--keep DIR]

* detection: an agent (tiny GPT) with a transient NaN at a known step, the monitor scraping
  and evaluating every second with the shipped rules. Wall time and steps from the bad step to
  the alert firing, to the rollback applied, and to the first step trained after the restored
  checkpoint.
* alertmanager: the same through a real Prometheus (scrape and evaluation every 5 s) and a real
  Alertmanager (``group_wait: 0s`` on the actions route) posting to the monitor's webhook.
* quality: the same tiny GPT trained N steps three times, fault-free, with an LR fault that
  makes it diverge, and with a NaN; the monitor recovers the faulty runs without a human. The
  final validation losses, compared with the fault-free run's.

Prints a table (docs/benchmarks.md records it). Needs the Debian prometheus and
prometheus-alertmanager packages for the alertmanager row.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lossguard.monitor.demo.recovery import Recovery, first_rollback, measure
from tests.support.alert_stack import MONITOR_WEBHOOK_PATH, alert_stack
from tests.support.processes import (
    REPO,
    free_port,
    start_agent,
    start_monitor,
    stop_process,
    wait_for,
)
from tests.support.runs import events, throttle, tiny_settings, write_config, write_monitor_config

SHIPPED_RULES = REPO / "alerts" / "lossguard.rules.yml"
TOKEN_ENV = "LOSSGUARD_MONITOR_TOKEN"


def agent_settings(
    runs: Path, cache: Path, run_id: str, checkpoint_every: int, **sections: Any
) -> dict[str, Any]:
    return tiny_settings(
        runs,
        cache,
        run={"id": run_id},
        # the tiny model's grad norm drifts upward as it learns, which the default detector
        # (6 std) reads as episodes that leave periodic checkpoints unhealthy; the faults
        # measured here (a NaN, a divergence) are far outside 25 std
        telemetry={"port": free_port(), "spikes": {"zscore": 25.0}},
        checkpoint={"every": checkpoint_every, "keep_last": 20},
        **sections,
    )


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def recovery(path: str, run_dir: Path, fired_at: float) -> tuple[str, Recovery]:
    """The measurement (labelled ``path``), once the run trained a step after its first
    rollback."""
    found = wait_for(
        lambda: measure(events(run_dir), records(run_dir), fired_at),
        60,
        "a step after the rollback",
    )
    return path, found


def fired_at(db: Path, alertname: str) -> float | None:
    """When the monitor recorded ``alertname`` firing (None before)."""
    if not db.exists():
        return None
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            row = conn.execute(
                "SELECT MIN(at) FROM alert_events WHERE kind = 'firing' AND labels LIKE ?",
                (f'%"alertname": "{alertname}"%',),
            ).fetchone()
        except sqlite3.OperationalError:
            return None
    return None if row[0] is None else float(row[0])


def action_created_at(db: Path) -> float | None:
    """When the monitor recorded its first action (None before)."""
    if not db.exists():
        return None
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            row = conn.execute("SELECT MIN(created_at) FROM actions").fetchone()
        except sqlite3.OperationalError:
            return None
    return None if row[0] is None else float(row[0])


LOG_ONLY = {"receivers": [{"name": "log", "log_configs": [{}]}], "route": {"receiver": "log"}}
NAN_STEP = 520
DETECTION_FAULTS = [
    {"kind": "nonfinite_loss", "step": NAN_STEP, "once": True},
    # 100 ms steps from shortly before the NaN on: the next checkpoint (step 1000, which
    # would end the alert) is 48 s after it
    throttle(0.1, from_step=NAN_STEP - 20),
]
DETECTION_TRAIN = {"max_steps": 10**7, "log_every": 1, "eval_every": 10**6}


@contextmanager
def monitored_agent(
    work: Path,
    cache: Path,
    run_id: str,
    faults: list[dict[str, Any]],
    train: dict[str, Any],
    checkpoint_every: int,
) -> Iterator[tuple[Path, Path, subprocess.Popen[str]]]:
    """A monitor with the shipped rules and an agent with ``faults`` under ``work``; yields
    the run directory, the monitor's state database and the agent's process."""
    runs = work / "runs"
    with shipped_monitor(work, runs) as db:
        settings = agent_settings(runs, cache, run_id, checkpoint_every, faults=faults, train=train)
        agent = start_agent(write_config(work / f"{run_id}.yaml", settings))
        try:
            yield runs / run_id, db, agent
        finally:
            stop_process(agent)


@contextmanager
def shipped_monitor(work: Path, runs: Path) -> Iterator[Path]:
    """A monitor with the shipped rules watching ``runs`` (notifications to its log only),
    its files under ``work``; yields its state database."""
    work.mkdir(parents=True, exist_ok=True)
    config, _ = write_monitor_config(
        work / "monitor.yml",
        [SHIPPED_RULES],
        scrape={"runs_root": str(runs)},
        notifications=LOG_ONLY,
    )
    monitor_process = start_monitor(config)
    try:
        yield work / "state.db"
    finally:
        stop_process(monitor_process)


def detection(work: Path, cache: Path) -> tuple[str, Recovery]:
    """A transient NaN, the monitor at 1 s scrape and evaluation with the shipped rules."""
    with monitored_agent(
        work, cache, "detect", DETECTION_FAULTS, DETECTION_TRAIN, checkpoint_every=500
    ) as (run_dir, db, _):
        wait_for(lambda: first_rollback(events(run_dir)), 300, "the rollback")
        fired = wait_for(lambda: fired_at(db, "LossNonFinite"), 10, "the firing alert")
        return recovery("embedded (1 s scrape, 1 s evaluation)", run_dir, fired)


def via_alertmanager(work: Path, cache: Path) -> tuple[str, Recovery]:
    """The same NaN through Prometheus (scrape and evaluation every 5 s, the shipped rules)
    and Alertmanager (the shipped actions route: group_wait 0s) to the monitor's webhook; the
    monitor's own rule never fires."""
    runs = work / "runs"
    quiet = work / "quiet.rules.yml"
    work.mkdir(parents=True, exist_ok=True)
    quiet.write_text(
        "groups: [{name: quiet, rules: [{alert: Never, expr: 'lossguard_step < -1'}]}]\n"
    )
    config, monitor_url = write_monitor_config(
        work / "monitor.yml", [quiet], scrape={"runs_root": str(runs)}, notifications=LOG_ONLY
    )
    token = "bench-token"
    monitor_process = start_monitor(config, env={TOKEN_ENV: token})
    settings = agent_settings(
        runs, cache, "viaam", 500, faults=DETECTION_FAULTS, train=DETECTION_TRAIN
    )
    metrics_url = f"http://127.0.0.1:{settings['telemetry']['port']}/metrics"
    try:
        with alert_stack(
            work / "stack",
            [metrics_url],
            f"{monitor_url}{MONITOR_WEBHOOK_PATH}",
            rule_files=[SHIPPED_RULES],
            token=token,
            scrape_interval="5s",
            evaluation_interval="5s",
            group_wait="0s",
            group_interval="5s",
        ):
            agent = start_agent(write_config(work / "viaam.yaml", settings))
            try:
                run_dir = runs / "viaam"
                wait_for(lambda: first_rollback(events(run_dir)), 300, "the rollback")
                received = wait_for(lambda: action_created_at(work / "state.db"), 10, "action")
                return recovery(
                    "Prometheus + Alertmanager (5 s scrape and evaluation, group_wait 0s)",
                    run_dir,
                    received,
                )
            finally:
                stop_process(agent)
    finally:
        stop_process(monitor_process)


def final_val_loss(run_dir: Path) -> float:
    evals = [r for r in records(run_dir) if r["kind"] == "eval"]
    return float(evals[-1]["val_loss"])


def quality(work: Path, cache: Path, steps: int) -> dict[str, tuple[float, int]]:
    """Final validation loss and rollbacks of a fault-free run and of two faulty ones. Every
    step takes at least 50 ms, so that LossSpikeNotRecovering's ``for: 1m`` passes within the
    run's length."""
    train = {"max_steps": steps, "log_every": 10, "eval_every": steps // 4}
    at = steps // 4
    scenarios: dict[str, list[dict[str, Any]]] = {
        "fault-free": [],
        f"lr x1000 for 300 steps from step {at} (diverges)": [
            {"kind": "lr_scale", "step": at, "duration": 300, "factor": 1000, "once": True}
        ],
        f"NaN loss at step {at}": [{"kind": "nonfinite_loss", "step": at, "once": True}],
    }
    results: dict[str, tuple[float, int]] = {}
    for name, faults in scenarios.items():
        run_id = f"q{len(results)}"
        with monitored_agent(
            work / run_id, cache, run_id, [*faults, throttle(0.05)], train, checkpoint_every=200
        ) as (
            run_dir,
            _,
            agent,
        ):
            agent.communicate(timeout=3600)
            rollbacks = sum(1 for e in events(run_dir) if e.get("event") == "rollback")
            results[name] = (final_val_loss(run_dir), rollbacks)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("detection", "alertmanager", "quality"))
    parser.add_argument("--steps", type=int, default=2400, help="quality: steps per run")
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = args.keep or Path(tempfile.mkdtemp(prefix="lossguard-recovery-"))
    cache = work / "cache"
    console = Console()
    found = []
    if args.only in (None, "detection"):
        found.append(detection(work / "detection", cache))
    if args.only in (None, "alertmanager"):
        found.append(via_alertmanager(work / "alertmanager", cache))
    if found:
        table = Table(title="Detection to recovery (wall time from the bad step)")
        for column in ("path", "bad step", "rolled back", "detected", "applied", "training again"):
            table.add_column(column)
        for path, r in found:
            table.add_row(
                path,
                str(r.bad_step),
                f"{r.from_step} -> {r.to_step}",
                f"{r.detected_s:.2f} s",
                f"{r.applied_s:.2f} s",
                f"{r.recovered_s:.2f} s ({r.from_step - r.bad_step} steps after)",
            )
        console.print(table)
    if args.only in (None, "quality"):
        results = quality(work / "quality", cache, args.steps)
        table = Table(title=f"Recovery quality: final validation loss after {args.steps} steps")
        for column in ("run", "rollbacks", "val loss", "vs fault-free"):
            table.add_column(column)
        clean = results["fault-free"][0]
        for name, (loss, rollbacks) in results.items():
            table.add_row(name, str(rollbacks), f"{loss:.4f}", f"{(loss / clean - 1):+.2%}")
        console.print(table)
    console.print(f"runs kept in {work}" if args.keep else "")


if __name__ == "__main__":
    main()
