"""Checkpoint writers run in background threads at the lowest CPU priority.

A save's background work (serialising, writing, fsyncing and hashing the files) should use the
CPU time the training leaves idle, not take it from the training threads: on Linux a thread's
nice value is its own, so the writer thread runs at nice 19 while the training threads keep
theirs. Where a thread's priority cannot be lowered (another OS, a sandbox that forbids it), the
writer runs at the process's priority.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable

LOWEST_PRIORITY = 19
"""The nice value of a checkpoint writer thread (the lowest priority on Linux)."""


def start_writer(target: Callable[[], None], name: str) -> threading.Thread:
    """Start ``target`` in a thread named ``name`` that first lowers its own CPU priority."""

    def run() -> None:
        lower_own_priority()
        target()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def lower_own_priority() -> None:
    """Set the calling thread's nice value to ``LOWEST_PRIORITY`` (Linux: per thread)."""
    if sys.platform != "linux":  # elsewhere the call would set the whole process's priority
        return
    with contextlib.suppress(OSError):  # not permitted here: run at the process's priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
