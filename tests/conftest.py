"""Shared fixtures: tiny configs on a small slice of the stdlib corpus, and CLI helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lossguard.agent.config import Config, parse_config

REPO = Path(__file__).resolve().parent.parent


def tiny_settings(runs: Path, cache: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A config dict for a model small enough to train in seconds on 2 CPU cores."""
    data: dict[str, Any] = {
        "run": {"dir": str(runs), "id": "tiny", "seed": 7, "device": "cpu"},
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
        "data": {"kind": "text", "max_bytes": 400_000, "cache_dir": str(cache)},
        "train": {
            "max_steps": 20,
            "batch_size": 8,
            "lr": 3e-3,
            "warmup_steps": 5,
            "eval_every": 10,
            "eval_batches": 4,
            "log_every": 5,
        },
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


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


def run_cli(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lossguard.agent.cli ARGS`` with its output captured (not a TTY)."""
    return subprocess.run(
        [sys.executable, "-m", "lossguard.agent.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        check=False,
    )
