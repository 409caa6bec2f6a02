"""Ending the ``lossguard-agent`` process without the interpreter's teardown.

Once torch (and dynamo, which every optimizer imports) is loaded, Python's own exit spends
0.7-0.9 s tearing down modules and freeing objects nobody will use again: time a supervisor's
restart, torchrun and every script that waits for the agent pay at each exit."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with ``code`` as Python would, less the teardown: the ``atexit`` handlers run
    (logging's flush, wandb's finish, multiprocessing's children) and stdout and stderr are
    flushed. Where a non-daemon thread still runs, the normal exit waits for it instead."""
    if any(
        thread is not threading.main_thread() and not thread.daemon and thread.is_alive()
        for thread in threading.enumerate()
    ):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream
            stream.flush()
    os._exit(code)
