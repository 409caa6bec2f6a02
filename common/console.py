"""The terminal: one rich console shared by log lines and live displays, and their formats."""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.logging import RichHandler

console = Console(log_path=False)


def stdout_is_tty() -> bool:
    return console.is_terminal


def format_duration(seconds: float) -> str:
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def setup_logging(level: int = logging.INFO) -> None:
    """Log lines on stderr; on a TTY through rich so they print above the live display."""
    handler: logging.Handler
    if stdout_is_tty():
        handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("lossguard")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
