"""Terminal progress: a live display on a TTY, plain structured lines elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from lossguard.common.console import console, format_duration, stdout_is_tty


class ProgressDisplay(Protocol):
    def update(self, record: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


# (record key, shown name, format) per record kind, in display order.
_LINE_FIELDS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "train": (
        ("train_loss", "loss", ".4f"),
        ("lr", "lr", ".3e"),
        ("grad_norm", "grad_norm", ".3f"),
        ("tokens_per_second", "tok/s", ".0f"),
        ("mfu", "mfu", ".3f"),
        ("step_time_seconds", "step_s", ".4f"),
    ),
    "eval": (("val_loss", "val_loss", ".4f"), ("val_perplexity", "val_ppl", ".2f")),
}


def logfmt(record: Mapping[str, Any], total_steps: int | None) -> str:
    """One ``key=value`` line for a metrics record, with the ETA for training records."""
    kind = str(record.get("kind", "train"))
    step = f"{record['step']}/{total_steps}" if total_steps else str(record["step"])
    fields = [f"kind={kind}", f"step={step}"]
    for key, name, spec in _LINE_FIELDS.get(kind, ()):
        value = record.get(key)
        if value is not None:
            fields.append(f"{name}={value:{spec}}")
    if total_steps and kind == "train" and record.get("step_time_seconds"):
        remaining = (total_steps - int(record["step"])) * float(record["step_time_seconds"])
        fields.append(f"eta={format_duration(remaining)}")
    return " ".join(fields)


class LineProgress:
    """Plain ``key=value`` lines, one per log interval: for logs and pipes."""

    def __init__(self, total_steps: int | None, stream: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.stream = stream

    def update(self, record: Mapping[str, Any]) -> None:
        print(logfmt(record, self.total_steps), file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        """Nothing to tear down for plain lines."""


class LiveProgress:
    """A rich progress bar with step, loss, tokens/s and ETA."""

    def __init__(self, total_steps: int | None, start_step: int, console: Console) -> None:
        self.console = console
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=start_step, loss="-", tps="-"
        )
        self._progress.start()

    def update(self, record: Mapping[str, Any]) -> None:
        if record.get("kind") == "eval":
            self.console.log(
                f"step {record['step']}: val_loss {record['val_loss']:.4f} "
                f"ppl {record['val_perplexity']:.2f}"
            )
            return
        self._progress.update(
            self._task,
            completed=record["step"],
            loss=f"{record['train_loss']:.4f}",
            tps=f"{record['tokens_per_second']:,.0f}",
        )

    def close(self) -> None:
        self._progress.stop()


def make_progress(total_steps: int | None, start_step: int = 0) -> ProgressDisplay:
    if stdout_is_tty():
        return LiveProgress(total_steps, start_step, console)
    return LineProgress(total_steps)
