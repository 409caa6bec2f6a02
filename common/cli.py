"""Command-line conventions shared by the console commands: exit codes and ``--set``."""

from __future__ import annotations

import argparse

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def add_override_option(parser: argparse.ArgumentParser, example: str) -> None:
    """``--set KEY=VALUE`` (repeatable), collected in ``overrides``."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config key, e.g. --set {example} (repeatable)",
    )
