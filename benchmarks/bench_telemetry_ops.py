"""Benchmark: how many device operations telemetry adds to a training step.

Builds the run twice, as ``lossguard-agent bench --overhead`` does (telemetry off, and fully
on with gradient diagnostics), trains ``--warmup`` steps, then profiles ``--steps`` steps of
each with ``torch.profiler`` and prints the aten operations per step: those called from Python
(whose caller is not another aten operation) and the leaf ones (which run the kernels), off,
on and added, and the added ones by name. ``--device cuda`` counts the same on a GPU.

    .venv/bin/python -m benchmarks.bench_telemetry_ops [--config configs/demo.yaml] [--steps 10]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from lossguard.agent.config import Config, load_config
from lossguard.agent.train.bench import scratch_config
from lossguard.agent.train.trainer import Trainer


def op_counts(cfg: Config, telemetry: bool, steps: int, warmup: int) -> tuple[int, int, dict]:
    """Aten operations in ``steps`` steps: called from Python, leaves, and the first by name."""
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as scratch:
        run = scratch_config(cfg, Path(scratch), f"ops-{telemetry}")
        run.telemetry.enabled = telemetry
        run.telemetry.host, run.telemetry.port = "127.0.0.1", 0
        run.telemetry.grad_diagnostics.enabled = telemetry
        trainer = Trainer(run, progress=False)
        try:
            for _ in range(warmup):
                trainer.train_step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    trainer.train_step()
        finally:
            trainer.close()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    parents = {id(e.cpu_parent) for e in events if e.cpu_parent is not None}
    called = collections.Counter(
        e.name for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")
    )
    leaves = sum(1 for e in events if id(e) not in parents)
    return sum(called.values()), leaves, called


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    overrides = [
        f"run.device={args.device}",
        "telemetry.port=0",
        "train.max_steps=100000",
        "checkpoint.every=null",
        "checkpoint.save_on_exit=false",
    ]
    cfg = load_config(args.config, overrides)
    off = op_counts(cfg, False, args.steps, args.warmup)
    on = op_counts(cfg, True, args.steps, args.warmup)
    for label, index in (("called from Python", 0), ("leaf", 1)):
        per_step = [count[index] / args.steps for count in (off, on)]
        print(
            f"aten ops per step, {label}: off {per_step[0]:.1f}, on {per_step[1]:.1f}, "
            f"added {per_step[1] - per_step[0]:.1f}"
        )
    added = collections.Counter(on[2])
    added.subtract(off[2])
    print("added, by name:", [(name, n / args.steps) for name, n in added.most_common(20) if n])
    return 0


if __name__ == "__main__":
    sys.exit(main())
