"""Benchmark: the per-step cost of the batch token statistics, against the sort they replaced.

Times ``token_statistics`` (a histogram: scatter-add and gather into a reused table sized to the
vocabulary) and the earlier exact method (a sort and two binary searches) over the same random
ids, on CPU or a GPU, at several token counts a step, and prints a table (microseconds a call,
the median of ``--rounds`` rounds of ``--calls`` calls; on a GPU synchronised once a round).

    .venv/bin/python -m benchmarks.bench_batch_tokens [--device cuda] [--vocabulary 50257]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch

from lossguard.agent.telemetry.batch_tokens import slots, token_statistics


def sorted_statistics(ids: torch.Tensor) -> torch.Tensor:
    """The earlier method: exact for any ids, one sort and two binary searches."""
    ordered = ids.reshape(-1).sort().values
    counts = torch.searchsorted(ordered, ordered, right=True) - torch.searchsorted(ordered, ordered)
    share = counts.to(torch.float64) / ordered.numel()
    distinct = share.reciprocal().sum() / ordered.numel() ** 2
    return torch.stack((-share.log2().mean(), distinct))


def time_us(call: Callable[[], object], device: torch.device, calls: int, rounds: int) -> float:
    """Median microseconds a call."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocabulary", type=int, default=50_257)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    table = torch.zeros(slots(args.vocabulary), dtype=torch.int32, device=device)
    print(f"| tokens a step | histogram us | sort us | sort / histogram |  ({device})")
    print("|---|---|---|---|")
    for tokens in (512, 4_096, 12_288, 65_536):
        ids = torch.randint(0, args.vocabulary, (tokens,), device=device)
        assert torch.allclose(token_statistics(ids, table), sorted_statistics(ids))
        histogram = time_us(
            functools.partial(token_statistics, ids, table), device, args.calls, args.rounds
        )
        by_sort = time_us(
            functools.partial(sorted_statistics, ids), device, args.calls, args.rounds
        )
        print(f"| {tokens:,} | {histogram:.1f} | {by_sort:.1f} | {by_sort / histogram:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
