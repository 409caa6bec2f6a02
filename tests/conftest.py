"""Shared fixtures: tiny configs on a small slice of the stdlib corpus, and CLI helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lossguard.agent.config import Config, parse_config

REPO = Path(__file__).resolve().parent.parent


def tiny_settings(runs: Path, cache: Path, **sections: Any) -> dict[str, Any]:
    """A config dict for a model small enough to train in seconds on 2 CPU cores."""
    data: dict[str, Any] = {
        "run": {"dir": str(runs), "id": "tiny", "seed": 7, "device": "cpu"},
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
        "data": {"kind": "text", "max_bytes": 400_000, "cache_dir": str(cache)},
        "telemetry": {"host": "127.0.0.1", "port": 0},
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
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
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


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, record every call that reads a tensor to the host (a device sync)."""
    reads: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, _original=original, _name=name, **kw: Any) -> Any:
            reads.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, read)
    return reads


def wait_for(predicate, timeout: float, what: str, interval: float = 0.005):
    """Poll ``predicate`` until it returns something truthy; at the deadline, fail naming it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start_agent(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``lossguard-agent run CONFIG ARGS`` in the background (output captured)."""
    return subprocess.Popen(
        [sys.executable, "-m", "lossguard.agent.cli", "run", str(config), "--no-progress", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


def step_records(run_dir: Path) -> dict[int, float]:
    """Train loss per step from metrics.jsonl, the last line for a step winning (as after a
    resume or rollback replays steps)."""
    losses: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record["kind"] == "train":
            losses[record["step"]] = record["train_loss"]
    return losses


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
