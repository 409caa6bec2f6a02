"""Ending the ``lossguard-agent`` process without the interpreter's teardown.

Once torch (and dynamo, which every optimizer imports) is loaded, Python's own exit spends
0.7-0.9 s tearing down modules and freeing objects nobody will use again: time that torchrun
and every script waiting for a finished agent paid at each exit."""

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
    flushed.

    Only a run that ended well (``code`` 0) skips it. A failure exits the normal way, with its
    usual timing: when a rank fails, a multi-node supervisor names the node whose group ended
    first, and a node whose ranks only saw a peer vanish must not end before the node where
    a rank died. Where a non-daemon thread still runs, the normal exit waits for it too."""
    if code != 0 or any(
        thread is not threading.main_thread() and not thread.daemon and thread.is_alive()
        for thread in threading.enumerate()
    ):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream
            stream.flush()
    os._exit(code)
