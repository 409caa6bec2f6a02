"""Command-line conventions shared by the console commands: exit codes and ``--set``."""

from __future__ import annotations

import argparse

from lossguard.common.exitcodes import EXIT_COMPLETED, EXIT_CONFIG, EXIT_PERMANENT

EXIT_OK = EXIT_COMPLETED
EXIT_FAILED = EXIT_PERMANENT  # a command that is not a run (status, check, ...) failed
EXIT_USAGE = EXIT_CONFIG
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
