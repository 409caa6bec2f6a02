"""Benchmark: tokens/s and step time of the configured run, per precision, in one process."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .config import Config


@dataclass(frozen=True)
class BenchResult:
    precision: str
    device: str
    params: int
    tokens_per_step: int
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_precision(cfg: Config, steps: int, warmup: int) -> BenchResult:
    """Time ``steps`` training steps after ``warmup`` untimed ones (synced at both ends only)."""
    from .trainer import Trainer

    trainer = Trainer(cfg, progress=False)
    try:
        for _ in range(warmup):
            trainer.train_step()
        _synchronize(trainer.device)
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        _synchronize(trainer.device)
        elapsed = time.perf_counter() - start
    finally:
        trainer.close()
    return BenchResult(
        precision=cfg.precision.dtype,
        device=str(trainer.device),
        params=trainer.raw_model.num_params(),
        tokens_per_step=trainer.sampler.tokens_per_step * trainer.dist.world_size,
        step_seconds=elapsed / steps,
    )


def run_benchmark(
    cfg: Config, precisions: Sequence[str], steps: int, warmup: int
) -> list[BenchResult]:
    """One result per precision, each a fresh model from the same seed, in a scratch run dir."""
    results = []
    with tempfile.TemporaryDirectory(prefix="lossguard-bench-") as scratch:
        for precision in precisions:
            run = cfg.model_copy(deep=True)
            run.precision.dtype = precision  # type: ignore[assignment]
            run.data.cache_dir = cfg.data.cache_dir or cfg.run.dir / ".cache"  # reuse the cache
            run.run.dir = Path(scratch)
            run.run.id = f"bench-{precision}"
            run.train.max_steps = max(run.train.max_steps, steps + warmup)
            results.append(bench_precision(run, steps, warmup))
    return results


def results_table(results: Sequence[BenchResult], steps: int) -> Table:
    base = results[0].tokens_per_second
    table = Table(title=f"lossguard bench ({steps} timed steps)")
    for column in ("precision", "device"):
        table.add_column(column)
    for column in ("params", "tokens/step", "step ms", "tokens/s", "vs first"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.precision,
            r.device,
            f"{r.params / 1e6:.2f}M",
            f"{r.tokens_per_step:,}",
            f"{r.step_seconds * 1e3:.1f}",
            f"{r.tokens_per_second:,.0f}",
            f"{r.tokens_per_second / base:.2f}x",
        )
    return table


def print_results(results: Sequence[BenchResult], steps: int) -> None:
    Console(width=120).print(results_table(results, steps))
