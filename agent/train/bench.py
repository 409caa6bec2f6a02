"""Benchmark: tokens/s and step time of the configured run, per precision, in one process."""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch
from rich.console import Console
from rich.table import Table

from lossguard.agent.config import Config
from lossguard.agent.train.corpus import cache_dir
from lossguard.common.config import ConfigError


@dataclass(frozen=True)
class BenchResult:
    precision: str
    device: str
    params: int
    tokens_per_step: int
    step_seconds: float
    flops_per_token: float | None = None
    peak_flops: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    @property
    def mfu(self) -> float | None:
        """Model FLOP/s over the peak of the precision's matmuls (as the telemetry's MFU)."""
        if self.flops_per_token is None or not self.peak_flops:
            return None
        return self.tokens_per_second * self.flops_per_token / self.peak_flops


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_precision(cfg: Config, steps: int, warmup: int) -> BenchResult:
    """Time ``steps`` training steps after ``warmup`` untimed ones (synced at both ends only)."""
    from lossguard.agent.train.trainer import Trainer

    trainer = Trainer(cfg, progress=False)
    telemetry = trainer.guard.telemetry
    try:
        if warmup:
            timed_block(trainer, warmup)
        step_seconds = timed_block(trainer, steps)
    finally:
        trainer.close()
    return BenchResult(
        precision=cfg.precision.dtype,
        device=str(trainer.device),
        params=trainer.raw_model.num_params(),
        tokens_per_step=trainer.sampler.tokens_per_step * trainer.dist.world_size,
        step_seconds=step_seconds,
        flops_per_token=telemetry.flops_per_token if telemetry else None,
        peak_flops=telemetry.peak.flops if telemetry and telemetry.peak else None,
    )


@dataclass(frozen=True)
class CheckpointBenchResult:
    params: int
    checkpoint_bytes: int
    save_seconds: float  # synchronous save: snapshot-free write, fsync, hash, rename
    stall_seconds: float  # what an async save costs the training loop (the copy to host)
    load_seconds: float  # verify hashes, load, restore every registered state

    @property
    def stall_ratio(self) -> float:
        return self.stall_seconds / self.save_seconds


def bench_checkpoint(cfg: Config, repeats: int) -> CheckpointBenchResult:
    """Median save, async stall and load times of the configured model with optimizer state."""
    from lossguard.agent.train.trainer import Trainer

    trainer = Trainer(cfg, progress=False)
    guard, store = trainer.guard, trainer.guard.checkpoints
    assert store is not None
    saves, stalls, loads = [], [], []
    try:
        for _ in range(repeats):
            trainer.train_step()  # a new step each time: optimizer state, a new checkpoint name
            start = time.perf_counter()
            guard.save("bench", wait=True)
            saves.append(time.perf_counter() - start)
            trainer.train_step()
            start = time.perf_counter()
            guard.save("bench")
            stalls.append(time.perf_counter() - start)
            store.wait()
            start = time.perf_counter()
            guard.restore("latest")
            loads.append(time.perf_counter() - start)
        latest = store.resolve("latest")[0]
        size = sum(f.stat().st_size for f in (store.root / latest.name).iterdir())
    finally:
        trainer.close()
    return CheckpointBenchResult(
        params=trainer.raw_model.num_params(non_embedding=False),
        checkpoint_bytes=size,
        save_seconds=statistics.median(saves),
        stall_seconds=statistics.median(stalls),
        load_seconds=statistics.median(loads),
    )


def scratch_config(cfg: Config, scratch: Path, run_id: str) -> Config:
    """The same run in a scratch run directory, keeping the data cache where it was."""
    run = cfg.model_copy(deep=True)
    run.data.cache_dir = cache_dir(cfg.data, cfg.run.dir)
    run.run.dir = scratch
    run.run.id = run_id
    return run


def run_checkpoint_benchmark(cfg: Config, repeats: int) -> CheckpointBenchResult:
    with tempfile.TemporaryDirectory(prefix="lossguard-bench-") as scratch:
        run = scratch_config(cfg, Path(scratch), "bench-checkpoint")
        run.checkpoint.every = None
        run.checkpoint.async_save = True
        run.checkpoint.keep_last = 2
        run.train.max_steps = max(run.train.max_steps, 2 * repeats + 1)
        return bench_checkpoint(run, repeats)


def checkpoint_table(result: CheckpointBenchResult, repeats: int) -> Table:
    table = Table(title=f"lossguard checkpoint bench (median of {repeats})")
    for column in ("params", "checkpoint", "sync save s", "async stall s", "stall/save", "load s"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result.params / 1e6:.1f}M",
        f"{result.checkpoint_bytes / 2**20:,.1f} MiB",
        f"{result.save_seconds:.3f}",
        f"{result.stall_seconds:.3f}",
        f"{result.stall_ratio:.3f}",
        f"{result.load_seconds:.3f}",
    )
    return table


@dataclass(frozen=True)
class OverheadResult:
    off_seconds: list[float]  # mean step time of each timed block, telemetry off
    on_seconds: list[float]  # the same, telemetry fully on and scraped every second
    steps: int
    labels: tuple[str, str] = ("off", "on + scraped 1/s")
    ratio_name: str = "on / off"

    @property
    def ratio(self) -> float:
        return statistics.median(self.on_seconds) / statistics.median(self.off_seconds)


class Scraper:
    """Scrapes a metrics URL every ``interval`` seconds in a thread, as Prometheus would."""

    def __init__(self, url: str, interval: float = 1.0) -> None:
        self.url = url
        self.interval = interval
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            requests.get(self.url, timeout=5).raise_for_status()
            self.scrapes += 1

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timed_block(trainer: Any, steps: int) -> float:
    """Mean step time over ``steps`` steps, the device synchronised at both ends only."""
    _synchronize(trainer.device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    _synchronize(trainer.device)
    return (time.perf_counter() - start) / steps


def check_fidelity_bench(cfg: Config, steps: int) -> None:
    """``--fp8-fidelity`` needs an FP8 run, and timed blocks that each hold the same number of
    checks (a whole number of check intervals); ConfigError otherwise."""
    every = cfg.telemetry.fp8_fidelity.every
    if cfg.precision.dtype != "fp8":
        raise ConfigError("--fp8-fidelity: needs precision.dtype fp8 (--set precision.dtype=fp8)")
    if steps % every:
        raise ConfigError(
            f"--steps: must be a multiple of telemetry.fp8_fidelity.every ({every}) with "
            "--fp8-fidelity, so that every timed block holds the same number of checks"
        )


def run_overhead_benchmark(
    cfg: Config, rounds: int, steps: int, warmup: int, *, fidelity: bool = False
) -> OverheadResult:
    """The same loop with telemetry off and fully on, interleaved (off-on, on-off, ...). With
    ``fidelity``: telemetry on in both, and the FP8 fidelity check in the second only."""
    from lossguard.agent.train.trainer import Trainer

    if fidelity:
        check_fidelity_bench(cfg, steps)
    with tempfile.TemporaryDirectory(prefix="lossguard-bench-") as scratch:
        trainers = {}
        for mode in ("off", "on"):
            run = scratch_config(cfg, Path(scratch), f"bench-{mode}")
            run.checkpoint.every = None
            run.checkpoint.save_on_exit = False
            run.train.max_steps = max(run.train.max_steps, warmup + rounds * steps + 1)
            run.telemetry.enabled = mode == "on" or fidelity
            run.telemetry.host, run.telemetry.port = "127.0.0.1", 0
            run.telemetry.grad_diagnostics.enabled = run.telemetry.enabled
            if fidelity:
                run.telemetry.fp8_fidelity.enabled = mode == "on"
            trainers[mode] = Trainer(run, progress=False)
        try:
            telemetry = trainers["on"].guard.telemetry
            assert telemetry is not None
            times: dict[str, list[float]] = {"off": [], "on": []}
            with Scraper(telemetry.urls[0]):
                for mode in ("off", "on") if warmup else ():
                    timed_block(trainers[mode], warmup)
                for block in range(rounds):
                    order = ("off", "on") if block % 2 == 0 else ("on", "off")
                    for mode in order:
                        times[mode].append(timed_block(trainers[mode], steps))
        finally:
            for trainer in trainers.values():
                trainer.close()
    if not fidelity:
        return OverheadResult(times["off"], times["on"], steps)
    check = cfg.telemetry.fp8_fidelity
    labels = ("telemetry on", f"+ FP8 fidelity every {check.every} ({check.dtype})")
    return OverheadResult(times["off"], times["on"], steps, labels, "check / no check")


def overhead_table(result: OverheadResult) -> Table:
    table = Table(
        title=f"lossguard telemetry overhead ({len(result.on_seconds)} x {result.steps} steps each)"
    )
    for column in ("telemetry", "median step ms", "min", "max"):
        table.add_column(column, justify="left" if column == "telemetry" else "right")
    for mode, times in zip(result.labels, (result.off_seconds, result.on_seconds), strict=True):
        table.add_row(
            mode,
            f"{statistics.median(times) * 1e3:.2f}",
            f"{min(times) * 1e3:.2f}",
            f"{max(times) * 1e3:.2f}",
        )
    table.caption = f"{result.ratio_name} = {result.ratio:.4f}"
    return table


def run_benchmark(
    cfg: Config, precisions: Sequence[str], steps: int, warmup: int
) -> list[BenchResult]:
    """One result per precision, each a fresh model from the same seed, in a scratch run dir."""
    results = []
    with tempfile.TemporaryDirectory(prefix="lossguard-bench-") as scratch:
        for precision in precisions:
            run = scratch_config(cfg, Path(scratch), f"bench-{precision}")
            run.precision.dtype = precision  # type: ignore[assignment]
            run.train.max_steps = max(run.train.max_steps, steps + warmup)
            results.append(bench_precision(run, steps, warmup))
    return results


def results_table(results: Sequence[BenchResult], steps: int) -> Table:
    base = results[0].tokens_per_second
    table = Table(title=f"lossguard bench ({steps} timed steps)")
    for column in ("precision", "device"):
        table.add_column(column)
    for column in ("params", "tokens/step", "step ms", "tokens/s", "vs first", "MFU"):
        table.add_column(column, justify="right")
    for r in results:
        mfu = r.mfu
        table.add_row(
            r.precision,
            r.device,
            f"{r.params / 1e6:.2f}M",
            f"{r.tokens_per_step:,}",
            f"{r.step_seconds * 1e3:.1f}",
            f"{r.tokens_per_second:,.0f}",
            f"{r.tokens_per_second / base:.2f}x",
            "-" if mfu is None else f"{mfu:.3f}",
        )
    return table


def print_table(table: Table) -> None:
    Console(width=120).print(table)
