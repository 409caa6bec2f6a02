"""The supervisor's process tree. torchrun starts each worker in a session of its own, so a
signal to the training command's process group misses the workers, and a worker outlives a
torchrun that was killed. The supervisor therefore makes itself a child subreaper (Linux):
orphaned workers become its children, it finds them as its descendants, and it ends them
before the next start."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable
from typing import cast

_PR_SET_CHILD_SUBREAPER = 36


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up before any fork (None: not Linux)."""
    try:
        return cast(Callable[..., int], ctypes.CDLL(None, use_errno=True).prctl)
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def libc_prctl() -> Callable[..., int] | None:
    return _prctl


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process, not to init (Linux only)."""
    prctl = libc_prctl()
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (from /proc; empty where there is none)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as fh:
                    children = [int(c) for c in fh.read().split()]
            except OSError:
                continue
            for child in children:
                if child not in found:
                    found.append(child)
                    todo.append(child)
    return found


def signal_tree(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid`` and every process below it."""
    for each in (pid, *descendants(pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(each, signum)


def end_orphans(timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process left below this one (the training command has ended: they are
    what it left behind) and reap them. The pids ended."""
    ended: list[int] = []
    deadline = time.monotonic() + timeout_s
    while (left := descendants(os.getpid())) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            if pid not in ended:
                ended.append(pid)
        for pid in left:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # our children (re-parented orphans); others: not ours
    return ended
