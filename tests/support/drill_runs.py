"""Launching tests/support/rank_drill.py under ``torchrun`` and judging how its ranks ended: the
helpers of tests/agent/test_rank_faults.py and benchmarks/bench_rank_chaos.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.support.processes import REPO, stop_process

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def start_drill(out: Path, plan: dict[str, Any], nproc: int = 2) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            *TORCHRUN,
            f"--nproc_per_node={nproc}",
            "-m",
            "tests.support.rank_drill",
            str(out),
            json.dumps(plan),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(out / "drill.log").open("w"),
        text=True,
        cwd=REPO,
        env=ENV,
    )


def finish_drill(
    process: subprocess.Popen[str], out: Path, nproc: int = 2, timeout: float = 180
) -> list[dict[str, Any]]:
    """Every rank's result once the run ended, after checking that the ranks entered the same
    collectives; a run that does not end within ``timeout`` is a hang, reported with the
    first collective where the ranks' sequences part."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        stop_process(process)
        raise AssertionError(f"hung: {divergence(out, nproc)}") from None
    same_collectives(out, nproc)
    missing = [r for r in range(nproc) if not (out / f"rank_{r}.json").exists()]
    assert not missing, f"ranks {missing} ended without a result:\n{log_tail(out)}"
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(nproc)]


def log_tail(out: Path) -> str:
    return (out / "drill.log").read_text()[-3000:]


def collectives(out: Path, rank: int) -> dict[str, list[str]]:
    """A rank's collectives in the order it entered them, by thread."""
    by_thread: dict[str, list[str]] = defaultdict(list)
    for line in (out / f"collectives_{rank}.txt").read_text().splitlines():
        thread, name = line.split(" ")
        by_thread[thread].append(name)
    return dict(by_thread)


def divergence(out: Path, nproc: int) -> str:
    """Where the ranks' sequences of collectives first differ (or that they do not)."""
    sequences = [collectives(out, rank) for rank in range(nproc)]
    for thread in sorted(set().union(*sequences)):
        lists = [s.get(thread, []) for s in sequences]
        for i in range(max(map(len, lists))):
            entered = [seq[i] if i < len(seq) else "nothing" for seq in lists]
            if len(set(entered)) > 1:
                ranks = ", ".join(f"rank {r} {name}" for r, name in enumerate(entered))
                return f"{thread}'s collective #{i + 1}: {ranks}"
    return "every rank entered the same collectives"


def same_collectives(out: Path, nproc: int) -> None:
    assert divergence(out, nproc) == "every rank entered the same collectives"
