"""Command-line conventions shared by the console commands: exit codes, ``--set``, and a quiet
exit when standard output's reader has gone."""

from __future__ import annotations

import argparse
import functools
import os
import select
import sys
from collections.abc import Callable
from typing import ParamSpec

from lossguard.common.exitcodes import EXIT_COMPLETED, EXIT_CONFIG, EXIT_PERMANENT

EXIT_OK = EXIT_COMPLETED
EXIT_FAILED = EXIT_PERMANENT  # a command that is not a run (status, check, ...) failed
EXIT_USAGE = EXIT_CONFIG
EXIT_INTERRUPTED = 130
EXIT_CLOSED_PIPE = 141
"""128 + SIGPIPE: the status a shell reports for ``cat``, ``grep`` or ``git`` whose reader
went away (``| head``), so ``set -o pipefail`` scripts see us as they see them."""

P = ParamSpec("P")


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


def quiet_on_closed_pipe(main: Callable[P, int]) -> Callable[P, int]:
    """A console command's ``main`` that ends quietly with :data:`EXIT_CLOSED_PIPE` when
    standard output's reader has gone (``| head``) instead of a BrokenPipeError traceback. A
    broken pipe that is not standard output (a socket) is raised as before. A command that
    returned a failure code keeps it (a run's outcome, for its scheduler, says more than the
    output it could not deliver)."""

    @functools.wraps(main)
    def quiet(*args: P.args, **kwargs: P.kwargs) -> int:
        code: int | None = None
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        except BrokenPipeError:
            if not _stdout_reader_gone():
                raise
            # the Python docs' "Note on SIGPIPE": the interpreter's last flush goes nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return code or EXIT_CLOSED_PIPE
        return code

    return quiet


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe or socket whose reading end is closed."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (OSError, ValueError):  # no file descriptor (a test's capture), or a closed one
        return False
