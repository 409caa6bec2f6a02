"""The SIGKILL soak of the checkpoint store: many rounds of a process saving 4 MiB checkpoints in
a loop, each killed at a random moment; after each, nothing hidden is left and every checkpoint
verifies and loads (the rounds of ``tests/agent/checkpoint/test_store.py``, which runs six).

    python -m benchmarks.bench_checkpoint_kills [--rounds N] [--seed S]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tests.agent.checkpoint.test_store import LOGGER, sigkill_rounds


class Count(logging.Handler):
    """Counts the store's warnings (a round that left something to clean up)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seed", type=int, default=20240611)
    args = parser.parse_args()
    warnings = Count()
    logging.getLogger(LOGGER).addHandler(warnings)
    logging.getLogger(LOGGER).setLevel(logging.WARNING)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lossguard-kills-") as scratch:
        newest = sigkill_rounds(Path(scratch) / "ck", args.rounds, args.seed)
    table = Table(title="SIGKILL at random moments: every round intact")
    for column in ("rounds", "checkpoints written", "store warnings", "seconds"):
        table.add_column(column, justify="right")
    written = sum(step - 1000 * n for n, step in enumerate(newest))
    table.add_row(
        str(len(newest)), str(written), str(warnings.count), f"{time.perf_counter() - start:.1f}"
    )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
