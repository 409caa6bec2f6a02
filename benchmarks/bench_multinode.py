"""Two "nodes" on this machine under chaos: two ``lossguard-supervise`` (node 0 leads) over one
run directory, each wrapping a ``torchrun --nnodes 2 --nproc-per-node 1`` with a c10d
rendezvous on 127.0.0.1.

    python -m benchmarks.bench_multinode [--kills 3] [--steps 120] [--seed 1] [--keep DIR]

The tiny GPT is trained ``--steps`` steps by the two nodes uninterrupted, then again while
node 1's worker is SIGKILLed ``--kills`` times at random moments. Every kill must restart both
nodes' groups from one checkpoint, count one crash, and end with final weights bitwise
identical to the uninterrupted run's. Reports restarts, steps trained again and the wall-time
overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.bench_supervisor import trained_since, weights_sha256
from lossguard.common.rundir.names import COORDINATION_DIR
from tests.support.processes import free_port, stop_process, wait_for
from tests.support.runs import events, last_step, tiny_settings, write_config

CHECKPOINT_EVERY = 10


def node_argv(run_dir: Path, config: Path, node: int, port: int, *options: str) -> list[str]:
    """``lossguard-supervise run`` for ``node`` of two, around its torchrun."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        f"--node-rank={node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_dir.name}",
        f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
        "--monitor-interval=0.2",
    ]
    agent = ["-m", "lossguard.agent.cli", "run", str(config), "--no-progress"]
    supervise = [sys.executable, "-m", "lossguard.supervisor.cli", "run"]
    return [*supervise, "--run-dir", str(run_dir), *options, "--", *torchrun, *agent]


def start_nodes(run_dir: Path, config: Path, *options: str) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [
        subprocess.Popen(
            node_argv(run_dir, config, node, port, *options),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(run_dir.parent / f"{run_dir.name}-node{node}.log").open("ab"),
        )
        for node in (0, 1)
    ]


def node_report(run_dir: Path, node: int) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / COORDINATION_DIR / f"node-{node}.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def worker_of(run_dir: Path, node: int, generation: int) -> int | None:
    """The worker process of ``node``'s torchrun in ``generation``, once it runs."""
    report = node_report(run_dir, node)
    if report.get("generation") != generation or report.get("status") is not None:
        return None
    torchrun = report.get("child_pid")
    try:
        children = Path(f"/proc/{torchrun}/task/{torchrun}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def two_nodes(
    work: Path, cache: Path, run_id: str, steps: int, **sections: Any
) -> tuple[Path, Path]:
    """The run directory and config of a two-node run of the tiny GPT."""
    work.mkdir(parents=True, exist_ok=True)
    train = {"max_steps": steps, "log_every": 1, "eval_every": 10**6}
    data = tiny_settings(work / "runs", cache, run={"id": run_id}, train=train, **sections)
    data.setdefault("checkpoint", {"every": CHECKPOINT_EVERY, "keep_last": 4})
    return work / "runs" / run_id, write_config(work / f"{run_id}.yaml", data)


def finish(nodes: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    try:
        return [node.wait(timeout) for node in nodes]
    finally:
        for node in nodes:
            stop_process(node)


def uninterrupted(work: Path, cache: Path, steps: int) -> tuple[Path, float]:
    run_dir, config = two_nodes(work, cache, "plain", steps)
    started = time.monotonic()
    statuses = finish(start_nodes(run_dir, config), 600)
    assert statuses == [0, 0], statuses
    return run_dir, time.monotonic() - started


def chaos(work: Path, cache: Path, steps: int, kills: int, seed: int) -> dict[str, Any]:
    """SIGKILL node 1's worker ``kills`` times, each in a new generation, at a random step
    after its first checkpoint."""
    plain_dir, plain_s = uninterrupted(work, cache, steps)
    run_dir, config = two_nodes(work, cache, "chaos", steps)
    rng = random.Random(seed)
    options = ("--backoff", "100ms", "--backoff-max", "1s", "--kill-after", "5s")
    started = time.monotonic()
    nodes = start_nodes(run_dir, config, *options)
    killed = 0
    try:
        for generation in range(1, kills + 1):
            pid = wait_for(lambda g=generation: worker_of(run_dir, 1, g), 120, "node 1's worker")
            seen = time.time()
            resume = node_report(run_dir, 1).get("resume_from")
            begun = int(resume[5:]) if resume else 0
            # a random step after the generation's first checkpoint, before halfway to the end
            low = begun + CHECKPOINT_EVERY + 2
            target = rng.randint(low, max(low, begun + (steps - begun) // 2))
            wait_for(
                lambda t=seen, s=target: trained_since(run_dir, t) and last_step(run_dir) >= s,
                120,
                f"step {target}",
            )
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            killed += 1
        statuses = [node.wait(600) for node in nodes]
    finally:
        for node in nodes:
            stop_process(node)
    chaos_s = time.monotonic() - started
    trail = events(run_dir)
    crashes = [e for e in trail if e.get("event") == "crash"]
    restarts = [e for e in trail if e.get("event") == "restart"]
    redone = sum(
        (c.get("step") or 0) - (int(c["resume_from"][5:]) if c.get("resume_from") else 0)
        for c in crashes
    )
    return {
        "statuses": statuses,
        "kills": killed,
        "crashes": len(crashes),
        "crashed_nodes": [c.get("node") for c in crashes],
        "crash_events": crashes,
        "restarts": len(restarts),
        "resumed": [e.get("checkpoint") for e in trail if e.get("event") == "resumed"],
        "resume_from": [r.get("resume_from") for r in restarts],
        "node_1_resumed_from": node_report(run_dir, 1).get("resume_from"),
        "steps_redone": redone,
        "plain_s": plain_s,
        "chaos_s": chaos_s,
        "identical": weights_sha256(plain_dir) == weights_sha256(run_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = args.keep or Path(tempfile.mkdtemp(prefix="lossguard-multinode-"))
    r = chaos(work, work / "cache", args.steps, args.kills, args.seed)
    table = Table(title=f"Two nodes, {args.steps} steps, SIGKILLs of node 1's worker")
    for column in ("kills", "crashes counted", "restarts", "steps re-done", "uninterrupted"):
        table.add_column(column)
    for column in ("chaos", "overhead", "weights"):
        table.add_column(column)
    table.add_row(
        str(r["kills"]),
        str(r["crashes"]),
        str(r["restarts"]),
        str(r["steps_redone"]),
        f"{r['plain_s']:.1f} s",
        f"{r['chaos_s']:.1f} s",
        f"+{r['chaos_s'] - r['plain_s']:.1f} s",
        "bitwise identical" if r["identical"] else "DIFFERENT",
    )
    Console().print(table)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
