"""Per-step overhead of the framework callbacks against the bare framework loop.

    python -m benchmarks.bench_integrations [--only huggingface|lightning] [--shape tiny|gpt2]
        [--rounds 6] [--steps 40] [--warmup 5] [--threads 1]

For each framework, in one process: the same GPT-2 (``tiny``: 4 layers, 128 wide, 64 tokens,
batch 8; ``gpt2``: GPT-2 small's 12 layers, 768 wide, 512 tokens, batch 8; fp32) trained
``--steps`` steps by the bare framework loop and by the loop with ``LossguardCallback``
(exporter on, log line every 10 steps, its exporter scraped every second), alternately
(bare-guarded, guarded-bare, ...) for ``--rounds`` rounds. A timing callback, last in the list,
takes the wall time between consecutive step ends; the first ``--warmup`` steps of each run are
left out. Prints the median step time of each side, their ratio (guarded / bare), and the time
spent inside the callback's hooks per step (mean over all steps of the guarded runs, log
intervals included), less blurred by the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.table import Table

from lossguard.agent.config import parse_config
from tests.support.integration_checks import RUN_ID, per_call, settings

VOCAB = 256


class Shape(NamedTuple):
    layers: int
    width: int
    sequence: int
    batch: int


SHAPES = {"tiny": Shape(4, 128, 64, 8), "gpt2": Shape(12, 768, 512, 8)}


class Bench(NamedTuple):
    """One framework: ``run`` trains in a fresh folder, with the callback or bare (None),
    appending each step end's time; ``callback`` makes one for a run directory; ``hooks`` are
    the callback's methods the framework calls."""

    run: Callable[[Path, Any, list[float]], None]
    callback: Callable[[Path], Any]
    hooks: tuple[str, ...]


def gpt2(shape: Shape) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=shape.layers,
        n_head=shape.width // 64,
        n_embd=shape.width,
        n_positions=shape.sequence,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def token_batches(shape: Shape, steps: int) -> torch.Tensor:
    size = (shape.batch * steps, shape.sequence)
    return torch.randint(0, VOCAB, size, generator=torch.Generator().manual_seed(0))


@contextmanager
def scraped(run_dir: Path) -> Iterator[None]:
    """Scrape the run's exporter every second while it trains, as Prometheus would."""
    done = threading.Event()

    def scrape() -> None:
        while not done.wait(1.0):
            try:
                url = json.loads((run_dir / "agent.json").read_text())["metrics_url"]
                with urllib.request.urlopen(url, timeout=5) as reply:
                    reply.read()
            except (OSError, ValueError, KeyError):
                pass  # not started yet, or finished

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def new_callback(callback_class: Any) -> Callable[[Path], Any]:
    """A callback of ``callback_class`` for a run directory: exporter on, a log line every 10."""
    config = parse_config(settings(train={"log_every": 10}))
    return lambda run_dir: callback_class(run_dir, config=config)


def huggingface(steps: int, shape: Shape) -> Bench:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lossguard.agent.integrations.huggingface import LossguardCallback

    ids = token_batches(shape, steps)
    data = [{"input_ids": row, "labels": row} for row in ids]

    class Clock(TrainerCallback):
        def __init__(self, ends: list[float]) -> None:
            self.ends = ends

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    def run(folder: Path, callback: Any, ends: list[float]) -> None:
        args = TrainingArguments(
            output_dir=str(folder / "hf"),
            max_steps=steps,
            per_device_train_batch_size=shape.batch,
            save_strategy="no",
            logging_steps=10,
            report_to="none",
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        )
        guard = [callback] if callback is not None else []
        trainer = Trainer(
            model=gpt2(shape), args=args, train_dataset=data, callbacks=[*guard, Clock(ends)]
        )
        trainer.train()

    hooks = ("_forward_done", "on_pre_optimizer_step", "on_step_end")
    return Bench(run, new_callback(LossguardCallback), hooks)


def lightning(steps: int, shape: Shape) -> Bench:
    import lightning.pytorch as pl

    from lossguard.agent.integrations.lightning import LossguardCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2(shape)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    class Clock(pl.Callback):
        def __init__(self, ends: list[float]) -> None:
            self.ends = ends

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    data = torch.utils.data.TensorDataset(token_batches(shape, steps))

    def run(folder: Path, callback: Any, ends: list[float]) -> None:
        guard = [callback] if callback is not None else []
        trainer = pl.Trainer(
            max_steps=steps,
            accelerator="auto",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            gradient_clip_val=1.0,
            default_root_dir=folder / "pl",
            callbacks=[*guard, Clock(ends)],
        )
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=shape.batch))

    hooks = (
        "on_train_batch_start",
        "on_before_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
    )
    return Bench(run, new_callback(LossguardCallback), hooks)


FRAMEWORKS: dict[str, Callable[[int, Shape], Bench]] = {
    "huggingface": huggingface,
    "lightning": lightning,
}


class Measured(NamedTuple):
    bare: list[float]  # step times (seconds) after the warm-up
    guarded: list[float]
    in_hooks: float  # seconds inside the callback's hooks per step, all steps of its runs


def measure(bench: Bench, rounds: int, warmup: int, root: Path) -> Measured:
    """Every round trains bare and with the callback, alternating which goes first."""
    times: dict[bool, list[float]] = {False: [], True: []}
    in_hooks: list[list[float]] = []  # per guarded run, filled as it trains
    guarded_steps = 0
    for round_ in range(rounds):
        for guarded in (False, True) if round_ % 2 == 0 else (True, False):
            folder = root / f"{round_}-{int(guarded)}"
            callback = bench.callback(folder / RUN_ID) if guarded else None
            if callback is not None:
                in_hooks.append(per_call(callback, bench.hooks, time.perf_counter))
            ends: list[float] = []
            with scraped(folder / RUN_ID):
                bench.run(folder, callback, ends)
            times[guarded] += [b - a for a, b in pairwise(ends[warmup:])]
            guarded_steps += len(ends) if guarded else 0
    return Measured(times[False], times[True], sum(map(sum, in_hooks)) / guarded_steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_integrations")
    parser.add_argument("--only", choices=sorted(FRAMEWORKS))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    options = parser.parse_args(argv)
    if options.rounds < 1 or options.steps < options.warmup + 2:
        parser.error("--rounds must be >= 1 and --steps >= --warmup + 2")
    torch.set_num_threads(options.threads)
    table = Table(title="per-step overhead of LossguardCallback (median step time)")
    columns = ("framework", "device", "bare ms", "with callback ms", "ratio", "in hooks ms")
    for column in columns:
        table.add_column(column)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    names = [options.only] if options.only else sorted(FRAMEWORKS)
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            bench = FRAMEWORKS[name](options.steps, SHAPES[options.shape])
            measured = measure(bench, options.rounds, options.warmup, Path(root) / name)
            bare, guarded = statistics.median(measured.bare), statistics.median(measured.guarded)
            times = (f"{seconds * 1e3:.2f}" for seconds in (bare, guarded, measured.in_hooks))
            bare_ms, guarded_ms, hooks_ms = times
            ratio = f"{guarded / bare:.3f}"
            table.add_row(name, device, bare_ms, guarded_ms, ratio, hooks_ms)
    Console().print(table)


if __name__ == "__main__":
    main()
