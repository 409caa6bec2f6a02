"""Benchmark: what an asynchronous ``dcp`` save costs the training loop of a sharded run.

Trains an FSDP2 GPT under ``torchrun --nproc_per_node 2`` (gloo, CPU) with an async checkpoint
every ``--every`` steps and reads the run directory: every step's wall time (``metrics.jsonl``,
one record a step) and each save's start and end (``events.jsonl``). A step overlaps a save
when it ran, in part, between the save's start (the step boundary it was taken at: the
staging blocks the step after it) and the save's publication. Prints the mean step time of the
steps that overlap a save, of those that do not, and their ratio.

Also prints the time a save costs the loop in all (``lost_s_per_save``: the overlapping steps'
time beyond the mean of the others), which does not depend on how many steps a save spans.
``--batch-size`` sets the sequences a step (64 tokens each): the ratio falls as a step's work
grows against the checkpoint's size.

    .venv/bin/python -m benchmarks.bench_sharded [--steps 80] [--every 10] [--batch-size 8] \
        [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.support.processes import REPO
from tests.support.runs import events, json_lines, tiny_settings, write_config

WARMUP_STEPS = 5


def settings(root: Path, steps: int, every: int, batch_size: int) -> dict[str, Any]:
    """A 7.2M-parameter GPT: a save (2 x ~45 MB: weights and AdamW moments) spans a few steps
    on CPU at the default batch."""
    return tiny_settings(
        root / "runs",
        root / "cache",
        model={"n_layer": 4, "n_head": 4, "n_embd": 384, "block_size": 64},
        train={"max_steps": steps, "batch_size": batch_size, "log_every": 1, "eval_every": 10**6},
        checkpoint={"every": every, "keep_last": 2, "save_on_exit": False},
        distributed={"strategy": "fsdp2"},
    )


def overlap_ratio(run_dir: Path) -> dict[str, float]:
    """Mean step time of steps overlapping a save, of the others, and the ratio."""
    steps = [r for r in json_lines(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    saves = [
        (e["time"] - e["seconds"], e["time"]) for e in events(run_dir) if e["event"] == "checkpoint"
    ]
    during: list[float] = []
    outside: list[float] = []
    for record in steps[WARMUP_STEPS:]:
        end = record["time"]
        start = end - record["step_time_seconds"]
        busy = any(start < saved and end > began for began, saved in saves)
        (during if busy else outside).append(record["step_time_seconds"])
    mean_during, mean_outside = statistics.mean(during), statistics.mean(outside)
    return {
        "saves": len(saves),
        "save_seconds": statistics.mean(end - start for start, end in saves),
        "steps_during": len(during),
        "steps_outside": len(outside),
        "step_s_during": mean_during,
        "step_s_outside": mean_outside,
        "ratio": mean_during / mean_outside,
        "lost_s_per_save": sum(t - mean_outside for t in during) / len(saves),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    root.mkdir(parents=True, exist_ok=True)
    config = write_config(root / "c.yaml", settings(root, args.steps, args.every, args.batch_size))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", "-m", "lossguard.agent.cli", "run", str(config)]
    subprocess.run(
        [*command, "--no-progress"],
        check=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    for key, value in overlap_ratio(root / "runs/tiny").items():
        print(f"{key:>15}: {value:.4f}" if isinstance(value, float) else f"{key:>15}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
