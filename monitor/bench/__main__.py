"""``python -m lossguard.monitor.bench``: the monitor beside Prometheus, one fleet per size.

``python -m lossguard.monitor.bench --agents 256 512 --seconds 20 --interval 1s``
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from lossguard.common.cli import quiet_on_closed_pipe
from lossguard.common.config import seconds
from lossguard.monitor.bench.compare import compare, comparison_table
from lossguard.monitor.bench.monitor import results_table
from lossguard.monitor.bench.prometheus import (
    prometheus_binary,
)
from lossguard.monitor.rules.rulefile import (
    RuleError,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lossguard.monitor.bench",
        description="Benchmark the monitor against Prometheus: the rules over simulated agents "
        "on a fixed interval.",
    )
    parser.add_argument(
        "--agents", type=int, nargs="+", default=[256], help="simulated agents, one run each (256)"
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds (30)")
    parser.add_argument("--interval", default="1s", help="scrape and evaluation interval (1s)")
    parser.add_argument("--warmup", type=int, default=3, help="cycles not measured (3)")
    parser.add_argument(
        "--rules", action="append", help="rule file (repeatable; alerts/lossguard.rules.yml)"
    )
    parser.add_argument(
        "--no-prometheus", action="store_true", help="the monitor only, no Prometheus baseline"
    )
    parser.add_argument(
        "--details", action="store_true", help="also each monitor run's detailed table"
    )
    return parser


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(width=200)  # the comparison is wide; cut, it would say nothing
    rows = []
    try:
        interval_s = seconds(args.interval)
        if min(args.agents) < 1 or not args.seconds > 0 or args.warmup < 0 or not interval_s > 0:
            raise ValueError("--agents, --seconds and --interval must be positive, --warmup ≥ 0")
        if not args.no_prometheus:
            prometheus_binary()
        for agents in args.agents:
            rows.append(
                compare(
                    agents=agents,
                    seconds_measured=args.seconds,
                    interval_s=interval_s,
                    rule_files=args.rules or ["alerts/lossguard.rules.yml"],
                    warmup_cycles=args.warmup,
                    prometheus=not args.no_prometheus,
                )
            )
            if args.details:
                console.print(results_table(rows[-1].monitor))
    except (ValueError, RuleError, RuntimeError) as exc:
        print(f"lossguard.monitor.bench: {exc}", file=sys.stderr)
        return 2
    console.print(comparison_table(rows))
    command = shlex.join(["python", "-m", "lossguard.monitor.bench", *sys.argv[1:]])
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    console.print(f"command: {command}\nload average at the end: {load}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
