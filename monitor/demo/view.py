"""The demo's live view: on a terminal, a panel (step, loss sparkline, tokens/s, MFU, memory,
alerts) under a scrolling log of what happens; piped, in CI or with ``--plain``, one plain
line per happening and a status line every few seconds."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Protocol, TextIO

from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from lossguard.monitor.demo.watch import Happening, RunStatus

BARS = "▁▂▃▄▅▆▇█"
PLAIN_STATUS_EVERY_S = 5.0
STYLES = {"info": "", "warn": "yellow", "bad": "bold red", "good": "bold green"}


def use_plain(plain: bool, stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Plain lines when asked, when ``stream`` is not a terminal, or in CI (``$CI`` set to
    anything but empty, 0 or false)."""
    in_ci = environ.get("CI", "").strip().lower() not in ("", "0", "false")
    return plain or in_ci or not stream.isatty()


def sparkline(values: Iterable[float]) -> str:
    """One bar per value, on a log scale between the smallest and the largest (a diverging
    loss spans orders of magnitude); non-positive and non-finite values as a space."""
    values = list(values)
    logs = [math.log(v) if v > 0 and math.isfinite(v) else None for v in values]
    known = [v for v in logs if v is not None]
    if not known:
        return ""
    low, high = min(known), max(known)
    span = high - low or 1.0
    return "".join(
        " " if v is None else BARS[min(len(BARS) - 1, int((v - low) / span * len(BARS)))]
        for v in logs
    )


def status_fields(status: RunStatus, firing: list[str]) -> list[tuple[str, str]]:
    """The status as (name, value) pairs, both views' content."""

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    val = "-"
    if status.val_loss is not None:
        val = f"{status.val_loss:.4g} (step {status.val_step})"
    memory = None if status.memory_bytes is None else status.memory_bytes / 2**20
    return [
        ("step", "-" if status.step is None else str(status.step)),
        ("train loss", number(status.train_loss, ".4g")),
        ("val loss", val),
        ("tokens/s", number(status.tokens_per_second, ",.0f")),
        ("MFU", number(None if status.mfu is None else status.mfu * 100, ".1f") + "%"),
        ("memory", number(memory, ",.0f") + " MiB"),
        ("alerts", ", ".join(firing) or "none"),
    ]


class View(Protocol):
    def tell(self, happenings: list[Happening], elapsed_s: float) -> None: ...

    def show(self, status: RunStatus, firing: list[str], elapsed_s: float) -> None: ...

    def close(self) -> None: ...


class PlainView:
    """One line per happening, ``[  12.3 s] text``; the status every few seconds, when it
    changed."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._shown_at: float | None = None
        self._shown = ""

    def tell(self, happenings: list[Happening], elapsed_s: float) -> None:
        for happening in happenings:
            self._line(elapsed_s, happening.text)

    def show(self, status: RunStatus, firing: list[str], elapsed_s: float) -> None:
        if self._shown_at is not None and elapsed_s - self._shown_at < PLAIN_STATUS_EVERY_S:
            return
        text = " | ".join(f"{k} {v}" for k, v in status_fields(status, firing))
        if status.step is None or text == self._shown:
            return
        self._shown_at, self._shown = elapsed_s, text
        self._line(elapsed_s, text)

    def close(self) -> None:
        self.stream.flush()

    def _line(self, elapsed_s: float, text: str) -> None:
        print(f"[{elapsed_s:6.1f} s] {text}", file=self.stream, flush=True)


class LiveView:
    """A rich Live panel at the bottom of the terminal; happenings scroll above it."""

    def __init__(self, stream: TextIO, title: str) -> None:
        self.console = Console(file=stream)
        self.title = title
        self._live = Live(console=self.console, refresh_per_second=4, transient=False)
        self._live.start()

    def tell(self, happenings: list[Happening], elapsed_s: float) -> None:
        for happening in happenings:
            line = Text(f"{elapsed_s:6.1f} s  ", style="dim")
            line.append(happening.text, style=STYLES[happening.tone])
            self._live.console.print(line)

    def show(self, status: RunStatus, firing: list[str], elapsed_s: float) -> None:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        for name, value in status_fields(status, firing):
            grid.add_row(name, value)
        grid.add_row("loss", Text(sparkline(status.losses), style="cyan"))
        title = f"{self.title} - {elapsed_s:.0f} s"
        self._live.update(Panel(grid, title=title, expand=False))

    def close(self) -> None:
        self._live.stop()
