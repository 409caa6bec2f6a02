"""The supervisor under chaos, and a hung run restarted through the monitor, on CPU.

    python -m benchmarks.bench_supervisor [--only chaos|stalls] [--kills 10] [--steps 600] \
        [--keep DIR]

* chaos: the tiny GPT trained ``--steps`` steps uninterrupted, then again under
  ``lossguard-supervise`` while the training process is SIGKILLed ``--kills`` times at random
  steps (each past a checkpoint the new process saved, the kills spread over the steps left)
  and the supervisor itself once, halfway, and started again. The final weights
  (sha256 of the model's tensors in the final checkpoint) must be bitwise identical; reports
  restarts, steps trained again, and the wall-time overhead against the uninterrupted run.
* stalls: a supervised run hits the ``hang`` fault; a monitor with the shipped rules
  (TrainingStalled: no step for 300 s, for 5m, action restart) asks the supervisor to restart
  it. Reports the time from the hang to the alert, to the restart, and to the first step
  trained again. Beside it, under the same monitor, a run paused for ``--pause`` seconds (600)
  and one whose synchronous checkpoint save takes ``--save`` seconds (60): neither may fire
  TrainingStalled or be restarted.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.bench_recovery import fired_at, records, shipped_monitor
from lossguard.common.control.client import ControlClient
from lossguard.common.rundir.checkpoints import STATE_FILE, list_checkpoints
from lossguard.common.rundir.metrics_log import last_logged
from lossguard.common.rundir.names import CHECKPOINT_DIR, SOCKET_NAME
from lossguard.common.rundir.supervisor_file import SupervisorInfo, pid_alive
from tests.support.processes import stop_process, supervisor_argv, wait_for
from tests.support.runs import events, last_step, step_records, tiny_settings, write_config

AGENT = [sys.executable, "-m", "lossguard.agent.cli", "run"]
CHECKPOINT_EVERY = 25


def weights_sha256(run_dir: Path) -> str:
    """sha256 over the model's tensors (name, dtype, bytes) in the run's newest checkpoint."""
    newest = list_checkpoints(run_dir / CHECKPOINT_DIR)[-1]
    state = torch.load(run_dir / CHECKPOINT_DIR / newest.name / STATE_FILE, weights_only=False)
    digest = hashlib.sha256()
    for name, tensor in sorted(state["state"]["model"].items()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def supervise(run_dir: Path, config: Path, *options: str) -> subprocess.Popen[bytes]:
    command = [*AGENT, str(config), "--no-progress"]
    return subprocess.Popen(
        supervisor_argv(run_dir, *options, command=command),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def training_pid(run_dir: Path, after: int | None) -> int | None:
    """The supervised training process, once it is a new one (not ``after``) and alive."""
    info = SupervisorInfo.read(run_dir)
    if info is None or info.state != "running" or info.child_pid in (None, after):
        return None
    return info.child_pid if pid_alive(info.child_pid) else None


def newest_checkpoint(run_dir: Path) -> int:
    """The step of the run's newest checkpoint (0: none yet)."""
    saved = list_checkpoints(run_dir / CHECKPOINT_DIR)
    return saved[-1].step if saved else 0


def trained_since(run_dir: Path, since: float) -> bool:
    logged = last_logged(run_dir).time
    return logged is not None and logged > since


def chaos(work: Path, cache: Path, steps: int, kills: int, seed: int) -> dict[str, Any]:
    train = {"max_steps": steps, "log_every": 10, "eval_every": 10**6}
    checkpoint = {"every": CHECKPOINT_EVERY, "keep_last": 4}
    work.mkdir(parents=True, exist_ok=True)
    plain = tiny_settings(work / "runs", cache, run={"id": "plain"}, train=train)
    plain["checkpoint"] = checkpoint
    started = time.monotonic()
    subprocess.run(
        [*AGENT, str(write_config(work / "plain.yaml", plain)), "--no-progress"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    plain_s = time.monotonic() - started
    chaotic = {**plain, "run": {**plain["run"], "id": "chaos"}}
    config = write_config(work / "chaos.yaml", chaotic)
    run_dir = work / "runs" / "chaos"
    options = ("--backoff", "100ms", "--backoff-max", "1s", "--max-restarts", str(kills + 5))
    rng = random.Random(seed)
    started = time.monotonic()
    supervisor = supervise(run_dir, config, *options)
    killed: int | None = None
    try:
        for kill in range(kills):
            pid = wait_for(lambda k=killed: training_pid(run_dir, k), 120, "a training process")
            seen = time.time()
            begun = newest_checkpoint(run_dir)
            low = begun + CHECKPOINT_EVERY + 2
            if low >= steps:
                break  # no checkpoint left to pass before the end
            # spread over the steps left, for the kills left
            high = begun + (steps - begun) // (kills - kill + 1)
            target = rng.randint(low, max(low, high))
            wait_for(
                lambda t=seen, s=target, b=begun: (
                    trained_since(run_dir, t)
                    and last_step(run_dir) >= s
                    and newest_checkpoint(run_dir) > b
                ),
                120,
                f"step {target} and a checkpoint past step {begun}",
            )
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                break  # the run finished before all the kills
            killed = pid
            if kill == kills // 2:  # the supervisor too, once: a new one takes over
                wait_for(lambda k=killed: training_pid(run_dir, k), 120, "the restart")
                supervisor.kill()
                supervisor.wait()
                supervisor = supervise(run_dir, config, *options)
        status = supervisor.wait(timeout=1800)
    finally:
        stop_process(supervisor)
    chaos_s = time.monotonic() - started
    trail = events(run_dir)
    crashes = [e for e in trail if e.get("event") == "crash"]
    restarts = [e for e in trail if e.get("event") == "restart"]
    resumed = {e.get("resume_from") for e in restarts}
    redone = 0
    for crash in crashes:
        back_to = int(crash["resume_from"][5:]) if crash.get("resume_from") else 0
        redone += (crash.get("step") or 0) - back_to
    return {
        "status": status,
        "kills": len(crashes),
        "supervisor_starts": sum(1 for e in trail if e.get("event") == "supervisor_start"),
        "restarts": len(restarts),
        "checkpoints_resumed": len(resumed),
        "steps_redone": redone,
        "plain_s": plain_s,
        "chaos_s": chaos_s,
        "identical": weights_sha256(work / "runs" / "plain") == weights_sha256(run_dir),
        "sha": weights_sha256(run_dir),
    }


def stalls(work: Path, cache: Path, pause_s: float, save_s: float) -> dict[str, Any]:
    """Three supervised runs under one monitor with the shipped rules: one hangs at step 200,
    one is paused for ``pause_s``, one spends ``save_s`` in a synchronous checkpoint save.
    Only the hung one may fire TrainingStalled or be restarted."""
    runs = work / "runs"
    train = {"max_steps": 10**6, "log_every": 5, "eval_every": 10**6}
    checkpoint = {"every": 50, "keep_last": 4}
    faults = {
        "hung": [{"kind": "hang", "step": 200, "once": True}],
        "paused": [],
        "saving": [{"kind": "slow_save", "step": 200, "seconds": save_s}],
    }
    supervisors = []
    with shipped_monitor(work, runs) as db:
        try:
            for run_id, run_faults in faults.items():
                settings = tiny_settings(runs, cache, run={"id": run_id}, train=train)
                settings.update(faults=run_faults, checkpoint=checkpoint)
                if run_id == "saving":
                    settings["checkpoint"] = {**checkpoint, "async": False}
                config = write_config(work / f"{run_id}.yaml", settings)
                supervisors.append(supervise(runs / run_id, config, "--kill-after", "10s"))
            hung, paused = runs / "hung", runs / "paused"
            wait_for(lambda: max(step_records(paused), default=0) >= 100, 300, "training")
            with ControlClient(socket_path=paused / SOCKET_NAME, timeout=60) as client:
                client.request("pause")
            pause_began = time.time()
            fault = wait_for(lambda: first_event(hung, "fault"), 300, "the hang")
            restart = wait_for(lambda: first_event(hung, "restart"), 1500, "the restart")
            again = wait_for(lambda: step_after(hung, restart["time"]), 300, "training again")
            fired = wait_for(lambda: fired_at(db, "TrainingStalled"), 10, "the alert")
            wait_for(lambda: time.time() - pause_began >= pause_s, pause_s + 10, "the pause")
            with ControlClient(socket_path=paused / SOCKET_NAME, timeout=60) as client:
                client.request("resume")
            wait_for(lambda: step_after(paused, time.time() - 1), 120, "the paused run again")
        finally:
            for supervisor in supervisors:
                stop_process(supervisor)
        stalled = alerted_runs(db, "TrainingStalled")
    return {
        "hang_step": fault["step"],
        "resumed_from": restart["resume_from"],
        "fired_s": fired - fault["time"],
        "restarted_s": restart["time"] - fault["time"],
        "training_s": again["time"] - fault["time"],
        "stalled_runs": sorted(stalled),
        "restarted_runs": sorted(r for r in faults if first_event(runs / r, "restart")),
        "save_s": save_seconds(runs / "saving"),
        "pause_s": pause_s,
    }


def step_after(run_dir: Path, since: float) -> dict[str, Any] | None:
    return next((r for r in records(run_dir) if r["kind"] == "train" and r["time"] > since), None)


def save_seconds(run_dir: Path) -> float:
    """The longest wait between two logged steps of the run (its slow save)."""
    times = [r["time"] for r in records(run_dir) if r["kind"] == "train"]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def alerted_runs(db: Path, alertname: str) -> set[str]:
    """The runs ``alertname`` went pending or firing for."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT json_extract(labels, '$.run_id') FROM alert_events "
            "WHERE json_extract(labels, '$.alertname') = ?",
            (alertname,),
        ).fetchall()
    return {row[0] for row in rows}


def first_event(run_dir: Path, kind: str) -> dict[str, Any] | None:
    return next((e for e in events(run_dir) if e.get("event") == kind), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("chaos", "stalls"))
    parser.add_argument("--pause", type=float, default=600, help="stalls: seconds paused")
    parser.add_argument("--save", type=float, default=60, help="stalls: seconds of the slow save")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = args.keep or Path(tempfile.mkdtemp(prefix="lossguard-supervisor-"))
    cache = work / "cache"
    console = Console()
    if args.only in (None, "chaos"):
        r = chaos(work / "chaos", cache, args.steps, args.kills, args.seed)
        table = Table(title=f"Chaos: {args.steps} steps, SIGKILLs of the training process")
        for column in ("kills", "supervisor restarts", "restarts", "steps re-done"):
            table.add_column(column)
        for column in ("uninterrupted", "supervised", "overhead", "weights"):
            table.add_column(column)
        table.add_row(
            str(r["kills"]),
            str(r["supervisor_starts"] - 1),
            str(r["restarts"]),
            str(r["steps_redone"]),
            f"{r['plain_s']:.1f} s",
            f"{r['chaos_s']:.1f} s",
            f"x{r['chaos_s'] / r['plain_s']:.2f}",
            ("bitwise identical" if r["identical"] else "DIFFERENT") + f" ({r['sha'][:12]})",
        )
        console.print(table)
        print(json.dumps({k: v for k, v in r.items() if k != "sha"}))
    if args.only in (None, "stalls"):
        h = stalls(work / "stalls", cache, args.pause, args.save)
        table = Table(title="A hung run (shipped TrainingStalled: 300 s, for 5m; action restart)")
        for column in ("hang at step", "alert fired", "restarted", "training again", "from"):
            table.add_column(column)
        table.add_row(
            str(h["hang_step"]),
            f"{h['fired_s']:.0f} s",
            f"{h['restarted_s']:.0f} s",
            f"{h['training_s']:.0f} s",
            str(h["resumed_from"]),
        )
        console.print(table)
        console.print(
            f"beside it: a {h['pause_s']:.0f} s pause and a {h['save_s']:.0f} s checkpoint save; "
            f"TrainingStalled pending or firing for {h['stalled_runs']}, "
            f"restarted: {h['restarted_runs']}"
        )
    console.print(f"runs kept in {work}" if args.keep else "")


if __name__ == "__main__":
    main()
