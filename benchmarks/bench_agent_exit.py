"""Benchmark: how long a finished ``lossguard-agent run`` takes to exit, with and without the
interpreter's teardown.

Runs a one-step tiny agent ``--runs`` times each way, alternating: ``python -m
lossguard.agent.cli`` (the command: :mod:`lossguard.agent.quick_exit`) and the same ``main``
ended by ``sys.exit`` (Python's full teardown), and prints a table of medians: seconds from the
process start to the ``done:`` log line, and from it to the exit.

    .venv/bin/python -m benchmarks.bench_agent_exit [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.runs import tiny_settings, write_config

WAYS = {
    "quick exit (the command)": ["-m", "lossguard.agent.cli"],
    "sys.exit (full teardown)": [
        "-c",
        "import sys; from lossguard.agent.cli import main; sys.exit(main())",
    ],
}


def timed_run(way: list[str], config: Path) -> tuple[float, float]:
    """(process start to ``done:``, ``done:`` to exit) of one run, in seconds."""
    started = time.monotonic()
    agent = subprocess.Popen(
        [sys.executable, *way, "run", str(config), "--no-progress", "--overwrite"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert agent.stderr is not None
    done = None
    for line in agent.stderr:
        if " done: " in line:
            done = time.monotonic()
    if agent.wait() != 0 or done is None:
        raise SystemExit(f"the agent failed (exit {agent.returncode})")
    return done - started, time.monotonic() - done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        settings = tiny_settings(root / "runs", root / "cache", train={"max_steps": 1})
        config = write_config(root / "c.yaml", settings)
        timed_run(WAYS["quick exit (the command)"], config)  # tokenises the corpus once
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in WAYS}
        for _ in range(args.runs):
            for name, way in WAYS.items():
                times[name].append(timed_run(way, config))
    print("| exit | start to done s | done to exit s |")
    print("|---|---|---|")
    for name, samples in times.items():
        to_done = statistics.median(s[0] for s in samples)
        to_exit = statistics.median(s[1] for s in samples)
        print(f"| {name} | {to_done:.2f} | {to_exit:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
