"""The ``live`` marker: a test that starts a process (an agent, a monitor, Prometheus, torchrun,
a shell) is marked ``live``, so that ``pytest -m "not live"`` is a quick loop. The marker is
checked, not trusted: a Python audit hook sees every process a test starts (``subprocess``,
``os.posix_spawn``, ``os.fork``, ``os.exec*``), during its setup or its call, and a test not
marked ``live`` that starts one fails, naming what it started."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

SPAWNS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.exec"})
INCIDENTAL = frozenset({"git", "uname"})
"""Programs that only answer a question (the commit checked out, the machine's name): no process
under test."""

_started: list[str] = []  # what the running test started, while one runs
_watching = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not (_watching and event in SPAWNS):
        return
    what = ""
    if event == "subprocess.Popen":
        argv = args[1] if isinstance(args[1], list | tuple) else [args[1]]
        what = str(args[0] or (argv[0] if argv else ""))
    elif event in ("os.posix_spawn", "os.exec"):
        what = str(args[0])
    if os.path.basename(what) not in INCIDENTAL:
        _started.append(f"{event} {what}".strip())


sys.addaudithook(_audit)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "live: starts processes (agents, monitors, servers); deselect with -m 'not live'"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Watch the test's setup and call (a teardown may stop what it started)."""
    global _watching
    _started.clear()
    _watching = True
    try:
        return (yield)
    finally:
        _watching = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    global _watching
    _watching = False
    result = yield
    if _started and item.get_closest_marker("live") is None:
        first = _started[0][:200]
        pytest.fail(
            f"{item.nodeid} starts processes ({len(_started)}, first: {first}) but is not "
            "marked live: add pytestmark = pytest.mark.live to its module (or mark the test)",
            pytrace=False,
        )
    return result
