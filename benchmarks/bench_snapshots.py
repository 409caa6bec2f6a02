"""In-memory snapshots and the ladder's first rung, measured with real processes.

    python -m benchmarks.bench_snapshots [--only lost|cost|skip|quiet|nan] [--device cpu|cuda]
                                    [--steps N] [--sharded] [--demo]

* lost: a NaN at step 1137 recovered by the monitor (shipped rules, 1 s scrape and
  evaluation): the steps between the restored state and the bad step, with the defaults
  (snapshots every 50 steps, disk checkpoints on the 30-minute cadence) and disk-only (no
  snapshots, a checkpoint every 1000 steps).
* cost: step time of the same run with snapshots every 50 steps and without (alternated, the
  median of 3 pairs, ``--pairs``); ``--device cuda`` for the GPU number; ``--sharded``: FSDP2
  under torchrun on 2 ranks (on CUDA one per GPU, up to 2), rank 0's numbers.
* skip: a one-step ``corrupt_batch`` spike at step 250, without and with
  ``mitigation.skip_spikes``, watched by the monitor: rollbacks and critical alerts, updates
  skipped as spikes, and the final validation loss against a fault-free run (rung 1 off).
* quiet: fault-free runs (``--steps``, log every step) with rung 1 on, judging the loss only
  and the loss and the grad norm: the updates each skipped (none should be); ``--demo`` for
  ``configs/demo.yaml``'s model instead of the tiny one.
* nan: ``configs/demo.yaml`` as shipped (log every step, so the time of the first step after
  the rollback is seen), a NaN at step 20, a monitor with ``configs/monitor.yml``'s rules,
  scrape and evaluation: where the rollback restored from, how long after the bad step
  training went on, and whether the page resolved.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sqlite3
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_recovery import SHIPPED_RULES, fired_at, records, shipped_monitor
from lossguard.agent.config import parse_config
from lossguard.agent.recovery import Recovery
from lossguard.agent.train.trainer import Trainer
from lossguard.common.config import read_config_file
from lossguard.monitor.demo.recovery import first_rollback, measure
from tests.agent.checkpoint.test_sharded import TORCHRUN
from tests.support.processes import REPO, free_port, start_agent, stop_process, wait_for
from tests.support.runs import events, tiny_settings, write_config

NAN_AT = 1137


def lost_work(work: Path, cache: Path) -> list[str]:
    """Steps lost per rollback, defaults against disk-only."""
    rows = []
    for label, sections in (
        ("defaults (snapshot every 50)", {}),
        (
            "disk only (checkpoint every 1000)",
            {"snapshot": {"every": None}, "checkpoint": {"every": 1000}},
        ),
    ):
        runs = work / label.split()[0] / "runs"
        settings = tiny_settings(
            runs,
            cache,
            train={"max_steps": 10**7, "log_every": 1, "eval_every": 10**6},
            telemetry={"port": free_port(), "spikes": {"zscore": 25.0}},
            faults=[{"kind": "nonfinite_loss", "step": NAN_AT, "once": True}],
            **sections,
        )
        with shipped_monitor(work / label.split()[0], runs):
            agent = start_agent(write_config(work / f"{label.split()[0]}.yaml", settings))
            try:
                run_dir = runs / "tiny"
                rollback = wait_for(lambda: first_rollback(events(run_dir)), 600, "rollback")  # noqa: B023
            finally:
                stop_process(agent)
        lost = NAN_AT - rollback["to_step"]
        rows.append(f"| {label} | {rollback['checkpoint']} | {lost} |")
    return rows


def cost_settings(work: Path, cache: Path, device: str, steps: int, on: bool) -> dict[str, Any]:
    """One cost run: snapshots every 50 steps (``on``) or none, no periodic checkpoints."""
    settings = tiny_settings(
        work / ("on" if on else "off") / f"{time.time_ns()}",
        cache,
        run={"device": device},
        train={"max_steps": steps, "log_every": 10, "eval_every": 10**6},
        telemetry={"port": 0},
        snapshot={"every": 50 if on else None},
        checkpoint={"every_seconds": None, "save_on_exit": False},
    )
    if device == "cuda":
        settings["model"] = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 512}
        settings["train"]["batch_size"] = 8
        settings["data"] = {"kind": "synthetic"}
    return settings


def timed_run(settings: dict[str, Any]) -> tuple[float, list[float]]:
    """Seconds per step of one in-process run (the first 20 steps not counted), and the
    seconds of each ``take_snapshot`` (the copy; on CUDA up to its end)."""
    taken: list[float] = []
    take = Recovery.take_snapshot

    def timed(self: Recovery, **kwargs: Any) -> bool:
        started = time.perf_counter()
        done = take(self, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copy's cost, not only its launch
        taken.append(time.perf_counter() - started)
        return done

    Recovery.take_snapshot = timed  # type: ignore[method-assign]
    try:
        trainer = Trainer(parse_config(settings), progress=False)
        trainer.fit()
    finally:
        Recovery.take_snapshot = take  # type: ignore[method-assign]
    path = trainer.run_path / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    step_times = [r["step_time_seconds"] for r in lines if r["kind"] == "train" and r["step"] > 20]
    return statistics.fmean(step_times), taken


def sharded_ranks(device: str) -> int:
    """Ranks of a sharded cost run: 2, or on CUDA one per GPU up to 2."""
    return 2 if device == "cpu" else min(2, torch.cuda.device_count())


def sharded_run(work: Path, settings: dict[str, Any]) -> tuple[float, list[float]]:
    """``timed_run`` under ``torchrun`` with FSDP2 (``sharded_ranks``); rank 0's numbers."""
    settings["distributed"] = {"strategy": "fsdp2"}
    config = write_config(work / f"{time.time_ns()}.yaml", settings)
    out = config.with_suffix(".json")
    nproc = f"--nproc_per_node={sharded_ranks(settings['run']['device'])}"
    subprocess.run(
        [*TORCHRUN, nproc, "-m", "benchmarks.bench_snapshots", "--worker", str(config)],
        check=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    step, taken = json.loads(out.read_text())
    return step, taken


def worker(config: Path) -> None:
    """Under torchrun: ``timed_run`` of ``config``; rank 0 writes the numbers beside it."""
    step, taken = timed_run(read_config_file(config))
    if os.environ.get("RANK", "0") == "0":
        config.with_suffix(".json").write_text(json.dumps([step, taken]))


def snapshot_cost(
    work: Path, cache: Path, device: str, steps: int, sharded: bool, runs: int
) -> list[str]:
    """Step times on and off (medians of ``runs`` alternated pairs), and the snapshots' own
    time amortised over ``snapshot.every`` steps (each snapshot timed where it is taken)."""
    work.mkdir(parents=True, exist_ok=True)
    taken: list[float] = []
    pairs = []
    for _ in range(runs):
        pair = []
        for snapshots in (True, False):
            settings = cost_settings(work, cache, device, steps, snapshots)
            step, times = sharded_run(work, settings) if sharded else timed_run(settings)
            pair.append(step)
            taken.extend(times[1:])  # not the first (buffers allocated)
        pairs.append(pair)
    ratio = statistics.median(on / off for on, off in pairs)
    on = statistics.median(p[0] for p in pairs)
    off = statistics.median(p[1] for p in pairs)
    snap = statistics.median(taken)
    amortised = 1 + snap / (50 * off)
    setup = f"{device}{f', fsdp2 x{sharded_ranks(device)}' if sharded else ''}"
    return [
        f"| {setup} | {steps} | {1000 * off:.1f} ms | {1000 * on:.1f} ms | {ratio:.3f} | "
        f"{1000 * snap:.1f} ms | {amortised:.4f} |"
    ]


def critical_alerts(db: Path) -> list[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT labels FROM alert_events WHERE kind = 'firing'").fetchall()
    found = [json.loads(row[0]) for row in rows]
    return [a["alertname"] for a in found if a.get("severity") == "critical"]


def skip_spike(work: Path, cache: Path) -> list[str]:
    """Fault-free against a one-step corrupt batch with rung 1 on, both monitored."""
    results = {}
    for name, label, faults, skip in (
        ("clean", "fault-free, rung 1 off", [], False),
        ("off", "corrupt_batch, rung 1 off", [250], False),
        ("on", "corrupt_batch, skip_spikes", [250], True),
    ):
        runs = work / name / "runs"
        settings = tiny_settings(
            runs,
            cache,
            train={"max_steps": 400, "log_every": 10, "eval_every": 400, "eval_batches": 20},
            telemetry={"port": free_port()},
            mitigation={"skip_spikes": skip},
            faults=[{"kind": "corrupt_batch", "step": step} for step in faults],
        )
        with shipped_monitor(work / name, runs) as db:
            agent = start_agent(write_config(work / f"{name}.yaml", settings))
            agent.wait(timeout=600)
            time.sleep(3)  # two more evaluations of the rules on the finished run's last scrape
            critical = critical_alerts(db) if db.exists() else []
        found = events(runs / "tiny")
        lines = (runs / "tiny" / "metrics.jsonl").read_text().splitlines()
        last = [json.loads(line) for line in lines if '"kind": "train"' in line][-1]
        val = [e for e in map(json.loads, lines) if e["kind"] == "eval"][-1]["val_loss"]
        rollbacks = sum(1 for e in found if e["event"] == "rollback")
        results[label] = (val, last["skipped_spikes"], rollbacks, critical)
    base = results["fault-free, rung 1 off"][0]
    return [
        f"| {label} | {val:.4f} | {100 * (val / base - 1):+.2f} % | {skips} | {rb} | "
        f"{', '.join(critical) or 'none'} |"
        for label, (val, skips, rb, critical) in results.items()
    ]


def quiet_skips(work: Path, cache: Path, steps: int, demo: bool) -> list[str]:
    """Fault-free runs with rung 1 on, judging the loss only (the default) and the loss and
    the grad norm (OLMo-core's pair): updates skipped, at the steps of log_every 1."""
    rows = []
    for signals in (["loss"], ["loss", "grad_norm"]):
        name = "-".join(signals)
        runs = work / name
        if demo:
            settings = read_config_file(REPO / "configs" / "demo.yaml")
            settings["run"].update(dir=str(runs), id="tiny")
            settings["data"]["cache_dir"] = str(cache)
        else:
            settings = tiny_settings(runs, cache)
        settings["train"].update(max_steps=steps, log_every=1, eval_every=100_000)
        settings.update(
            telemetry={"host": "127.0.0.1", "port": 0},
            snapshot={"every": None},
            mitigation={"skip_spikes": True, "signals": signals},
        )
        Trainer(parse_config(settings), progress=False).fit()
        trains = [r for r in records(runs / "tiny") if r["kind"] == "train"]
        pairs = itertools.pairwise(trains)
        at = [b["step"] for a, b in pairs if b["skipped_spikes"] > a["skipped_spikes"]]
        model = "demo" if demo else "tiny"
        rows.append(f"| {model} | {steps} | {', '.join(signals)} | {len(at)} | {at} |")
    return rows


def default_nan(work: Path) -> list[str]:
    """configs/demo.yaml, a NaN at step 20, configs/monitor.yml's rules and cadence."""
    runs = work / "runs"
    settings = read_config_file(REPO / "configs" / "demo.yaml")
    settings["run"].update(dir=str(runs), id="nan")
    settings["train"]["log_every"] = 1
    settings["telemetry"] = {"host": "127.0.0.1", "port": free_port()}
    settings["faults"] = [{"kind": "nonfinite_loss", "step": 20, "once": True}]
    monitor = read_config_file(REPO / "configs" / "monitor.yml")
    with shipped_monitor(work, runs) as db:
        assert monitor["scrape"]["interval"] == "1s" and SHIPPED_RULES.exists()
        agent = start_agent(write_config(work / "nan.yaml", settings))
        try:
            run_dir = runs / "nan"
            wait_for(lambda: first_rollback(events(run_dir)), 600, "the rollback")
            fired = wait_for(lambda: fired_at(db, "LossNonFinite"), 10, "the firing alert")
            found = wait_for(
                lambda: measure(events(run_dir), records(run_dir), fired), 60, "a step"
            )
            resolved = wait_for(lambda: resolved_at(db, "LossNonFinite"), 30, "the resolve")
        finally:
            stop_process(agent)
    rollback = first_rollback(events(run_dir))
    assert rollback is not None
    return [
        f"| {rollback['checkpoint']} | {found.bad_step - found.to_step} | "
        f"{found.detected_s:.1f} s | {found.applied_s:.1f} s | {found.recovered_s:.1f} s | "
        f"{resolved - fired:.1f} s after firing |"
    ]


def resolved_at(db: Path, alertname: str) -> float | None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        row = conn.execute(
            "SELECT MIN(at) FROM alert_events WHERE kind = 'resolved' AND labels LIKE ?",
            (f'%"alertname": "{alertname}"%',),
        ).fetchone()
    return None if row[0] is None else float(row[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("lost", "cost", "skip", "quiet", "nan"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sharded", action="store_true", help="cost: FSDP2 on 2 ranks")
    parser.add_argument("--pairs", type=int, default=3, help="cost: on/off pairs")
    parser.add_argument("--demo", action="store_true", help="quiet: configs/demo.yaml's model")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        if args.only in (None, "lost"):
            print("| setting | restored | steps lost |", *lost_work(work / "lost", cache), sep="\n")
        if args.only in (None, "cost"):
            print("| device | steps | off | on | ratio | one snapshot | amortised |")
            cost = snapshot_cost(
                work / "cost", cache, args.device, args.steps, args.sharded, args.pairs
            )
            print(*cost, sep="\n")
        if args.only in (None, "skip"):
            print("| run | val loss | vs fault-free | spikes skipped | rollbacks | critical |")
            print(*skip_spike(work / "skip", cache), sep="\n")
        if args.only in (None, "quiet"):
            print("| model | steps | signals | skipped | at steps |")
            print(*quiet_skips(work / "quiet", cache, args.steps, args.demo), sep="\n")
        if args.only in (None, "nan"):
            print("| restored | steps lost | fired | rolled back | training again | resolved |")
            print(*default_nan(work / "nan"), sep="\n")


if __name__ == "__main__":
    main()
