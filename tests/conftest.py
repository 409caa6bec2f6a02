"""Shared fixtures: tiny configs on a small slice of the stdlib corpus. The helpers tests
import live in ``tests.support``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lossguard.agent.config import Config, parse_config
from tests.support.live_marker import (  # noqa: F401 (the live marker's hooks)
    pytest_configure,
    pytest_runtest_protocol,
    pytest_runtest_teardown,
)
from tests.support.runs import sliced_settings, tiny_settings

pytest_plugins = ["tests.support.schedule"]  # the order and grouping of scripts/test.sh's run

# One intra-op thread per test process, and per process a test starts (they inherit the
# variable: a supervisor's training, the README's commands): the workers and their processes
# already outnumber the cores, and torch's default of a thread per core makes each spin-wait for
# the others (a tiny run took twice the CPU with two threads on 2 busy cores).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every Python process a test starts prints its threads' stacks on a fatal signal: one that
# will not stop gets SIGABRT from stop_process and leaves where it hung in its log.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenised-corpus cache for the whole session."""
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture
def tiny_config(tmp_path: Path, corpus_cache: Path):
    """Build a tiny Config: ``tiny_config(train={"max_steps": 30}, precision={...})``."""

    def build(**sections: dict[str, Any]) -> Config:
        return parse_config(tiny_settings(tmp_path / "runs", corpus_cache, **sections))

    return build


@pytest.fixture
def sliced_config(tmp_path: Path, corpus_cache: Path):
    """``tiny_config`` on ``corpus_slice``: the same Config, its Trainer built faster."""

    def build(**sections: dict[str, Any]) -> Config:
        return parse_config(sliced_settings(tmp_path / "runs", corpus_cache, **sections))

    return build
